"""One document's indexing progress on a stream (stderr), shared by ``ragspec ingest --url`` (which polls the
server's document row) and the local ``ragspec ingest`` / ``reindex`` (called back by the store at each stage
and embedding batch), so both print the same lines: ``NAME: STATUS NN% [stage]``.

On a terminal the line is rewritten in place (``\\r``, padded to cover a longer earlier line) and ended with
one newline; otherwise each change is a line of its own, so a log or a pipe keeps every step.
"""

from __future__ import annotations

from typing import TextIO

ACTIVE = ("queued", "indexing")  # the statuses whose line carries the stage message


def progress_text(name: str, status: str, progress: float, message: str | None) -> str:
    """``records.txt: indexing  40% embedding passages: 64 of 200`` (the stage only while not finished)."""
    line = f"{name}: {status} {round(100 * float(progress)):3d}%"
    if status in ACTIVE and message:
        line += f" {message}"
    return line


class ProgressLine:
    """Writes a document's progress to ``out`` whenever it changes (a repeated state is not written again)."""

    def __init__(self, name: str, out: TextIO) -> None:
        self.name = name
        self.out = out
        self.tty = out.isatty()
        self.shown = ""

    def show(self, status: str, progress: float, message: str | None) -> None:
        line = progress_text(self.name, status, progress, message)
        if line == self.shown:
            return
        self.out.write(f"\r{line:<{len(self.shown)}}" if self.tty else line + "\n")
        self.out.flush()
        self.shown = line

    def close(self) -> None:
        """Ends a line rewritten in place (a terminal), so what follows starts on a line of its own."""
        if self.tty and self.shown:
            self.out.write("\n")
            self.out.flush()
