"""Uncached single-row reference for block-level decoding: slow and obviously right.

A pass feeds the whole sequence plus masks up to the end of the current block and
accepts the confident prefix of the remaining candidates, never past the block's
end. The tests hold every row of the cached batch decoders to it token for token.
"""

from __future__ import annotations

from functools import partial

from tests.reference import reference_decode

reference_block_decode = partial(reference_decode, block_capped=True)
