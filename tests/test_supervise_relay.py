"""`tandem up`'s log relay (tandem/cli/supervise.py `_lines`): a child's output line by line as the pipe
delivers it, read in chunks — the unbuffered pipe's readline() read one byte per system call (~0.6 ms of CPU per
relayed line; docs/PERFORMANCE.md, session 36)."""

import os


def test_the_relay_reads_a_childs_output_in_chunks(monkeypatch):
    """`tandem up` relays every child's log lines: they are read as the pipe delivers them (a line split
    across writes is joined, the last one without a newline kept), not a byte per system call."""
    from tandem.cli import supervise

    reads = []
    real_read = os.read
    monkeypatch.setattr(supervise.os, "read", lambda fd, n: reads.append(n) or real_read(fd, n))
    r, w = os.pipe()
    lines = [f'{{"event": "request finished", "request_id": "req-{i:04d}", "pad": "{"x" * 250}"}}'.encode()
             for i in range(200)]
    os.write(w, b"\n".join(lines[:100]) + b"\n" + lines[100][:40])
    os.write(w, lines[100][40:] + b"\n" + b"\n".join(lines[101:]) + b"\n" + b"no newline at the end")
    os.close(w)
    try:
        assert list(supervise._lines(r)) == [*lines, b"no newline at the end"]
    finally:
        os.close(r)
    assert len(reads) <= 4  # two writes and the end: one read each at most (a byte at a time was ~55,000)
