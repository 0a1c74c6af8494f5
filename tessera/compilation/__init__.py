"""The split and the compile: a traced graph cut into pieces, each piece compiled per size by a
compiler (here or in a compile worker), its artifact kept as a file, and what runs it."""
