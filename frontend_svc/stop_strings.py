"""Stop-string matching over streamed text (vLLM ``detokenizer.check_stop_strings``), a pure function."""

from __future__ import annotations


def check_stop_strings(
    output_text: str, new_char_count: int, stop: list[str], include_in_output: bool
) -> tuple[str, int] | None:
    """Find a stop string completed by the last ``new_char_count`` characters of ``output_text``.

    Only occurrences that end within the new characters are considered (each search starts
    ``new_char_count + len(stop) - 1`` characters from the end). When several stop strings match, the one that
    completes earliest wins; ties go to the earlier entry of ``stop``.

    Returns:
        None when nothing matched, else ``(stop_string, truncate_to)``: the text is to be cut at ``truncate_to``
        (the start of the stop string, or its end when ``include_in_output``); -1 means it already ends there.
    """
    if not new_char_count or not stop:
        return None
    best: tuple[int, str, int] | None = None  # (end of match, stop string, start of match)
    for stop_str in stop:
        start = output_text.find(stop_str, 1 - new_char_count - len(stop_str))
        if start == -1:
            continue
        end = start + len(stop_str)
        if best is None or end < best[0]:
            best = (end, stop_str, start)
    if best is None:
        return None
    end, stop_str, start = best
    if not include_in_output:
        return stop_str, start
    return stop_str, -1 if end >= len(output_text) else end
