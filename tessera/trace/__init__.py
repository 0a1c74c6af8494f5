"""The trace and the call check: Dynamo's one trace of a model, what it assumed of a call, the
model's traces, the guarded path, and the warm start with its whole-model artifact."""
