"""What a pass commits: its accepted tokens, cut at the token limit, the first stop id and the first stop string.

Every decoder (loop.py, the batch schemes, the reference decoders, the
benchmark's transformers runs) cuts through ``commit_tokens``; the text layer of
loop.py cuts stop strings through ``cut_at_stop_string``.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

EOS, STOP, LENGTH = "eos", "stop", "length"  # finish reasons: a stop id, a stop string, the token limit


def commit_tokens(tokens: Sequence[int], room: int, stop_ids: Collection[int]) -> tuple[list[int], str | None]:
    """(the tokens to commit, the finish reason or None) for a pass that accepted ``tokens``.

    At most ``room`` tokens (what the token limit leaves) are kept, up to and including
    the first stop id ("eos"); filling the room ends the run too ("length").
    """
    kept = list(tokens[: max(room, 0)])
    for i, token in enumerate(kept):
        if token in stop_ids:
            return kept[: i + 1], EOS
    return kept, LENGTH if len(kept) >= room else None


def cut_at_stop_string(pieces: list[str], emitted: str, stops: Sequence[str]) -> int | None:
    """If a stop string is now complete, trim ``pieces`` to end with it and return how many to keep.

    ``emitted`` is the text of earlier passes, ``pieces`` the text of this pass's tokens.
    The output keeps the stop string, as transformers' stop strings do: text already
    streamed is never taken back, and a stop string may span several passes.
    """
    if not stops:
        return None
    text = emitted + "".join(pieces)
    start = max(0, len(emitted) - max(map(len, stops)) + 1)
    ends = [i + len(s) for s in stops if (i := text.find(s, start)) >= 0]
    if not ends:
        return None
    end, length = min(ends), len(emitted)  # end > len(emitted): earlier passes had no complete stop
    for k, piece in enumerate(pieces):
        if length + len(piece) >= end:
            pieces[k] = piece[: end - length]
            return k + 1
        length += len(piece)
    return len(pieces)
