"""A diffusers pipeline with its denoiser and VAE decoder compiled by tessera, batch dynamic.

    pipe.unet = tessera.compile(pipe.unet)
    pipe.vae.decode = tessera.compile(pipe.vae.decode)

The pipeline is unchanged: it still reads ``pipe.unet.config`` and ``pipe.unet.dtype`` (a compiled
model answers with its model's attributes). The batch dim of every tensor argument is dynamic by
default, so one trace serves one image or several (classifier-free guidance doubles the UNet's
batch). A tiny pipeline built from a config (random weights, nothing downloaded) runs at batch 1
and 2; the images must equal eager's. Run:
``python examples/diffusers_pipeline.py [--backend eager]``; exit status 0 when they match.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

import tessera


def tiny_pipeline() -> object:
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=8,
    )
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        block_out_channels=(32, 64),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        norm_num_groups=8,
        sample_size=32,
    )
    with warnings.catch_warnings():  # the scheduler's defaults predate its config keys
        warnings.simplefilter("ignore", FutureWarning)
        scheduler = DDIMScheduler(steps_offset=1, clip_sample=False)
        # No text encoder or tokenizer (they need downloaded vocabularies): prompts come as
        # embeddings, as a service that caches them would pass them.
        pipe = StableDiffusionPipeline(
            vae=vae.eval(),
            text_encoder=None,
            tokenizer=None,
            unet=unet.eval(),
            scheduler=scheduler,
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe: object, batch: int, steps: int = 3) -> torch.Tensor:
    embeds = torch.randn(batch, 7, 32, generator=torch.Generator().manual_seed(batch))
    return pipe(  # type: ignore[operator]
        prompt_embeds=embeds,
        negative_prompt_embeds=torch.zeros_like(embeds),
        num_inference_steps=steps,
        height=32,
        width=32,
        output_type="pt",
        generator=torch.Generator().manual_seed(0),
    ).images


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args()
    pipe = tiny_pipeline()
    expected = {batch: generate(pipe, batch) for batch in (1, 2)}

    pipe.unet = tessera.compile(pipe.unet, backend=args.backend)  # type: ignore[attr-defined]
    pipe.vae.decode = tessera.compile(pipe.vae.decode, backend=args.backend)  # type: ignore[attr-defined]
    matches = True
    for batch in (1, 2, 1):
        start = time.perf_counter()
        image = generate(pipe, batch)
        seconds = time.perf_counter() - start
        same = torch.allclose(image, expected[batch], atol=1e-4, rtol=1e-4)
        matches = matches and same
        print(f"batch {batch}: {tuple(image.shape)} in {seconds:.2f}s, equal to eager: {same}")
    for name, compiled in (("unet", pipe.unet), ("vae.decode", pipe.vae.decode)):  # type: ignore[attr-defined]
        report = compiled.report
        print(f"{name}: dynamic {compiled.marked_dims}; {report.summary() if report else 'no report'}")
    return 0 if matches else 1


if __name__ == "__main__":
    raise SystemExit(main())
