"""Triton kernels, each beside a pure-PyTorch reference (the Triton kernels issue).

Integer arguments that change from step to step (token counts, tiles per request, the block
table's width, split counts) are listed in ``do_not_specialize``: Triton otherwise compiles a
separate variant when such a value is 1 or a multiple of 16, which lands as a multi-second
compile in the middle of a job the first time a step happens to have, say, 8,192 tokens.
"""
