"""A safetensors header's lengths are checked as the file is opened: every tensor's span is its
shape times its dtype's size, the spans tile the data section without gap or overlap, and the
data section ends the file, the rules the ``safetensors`` library itself enforces (each damaged
file below is refused by it too: the reference)."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from olmax.errors import OlmaxError
from olmax.interop.safetensors import read_safetensors_header, write_safetensors

LAYOUT = [("a", (4, 2), np.dtype(np.float32)), ("b", (3,), np.dtype(np.float32))]


def _file(tmp_path, edit=None, tail=b""):
    path = tmp_path / "model.safetensors"
    write_safetensors(path, LAYOUT, [("a", np.ones((4, 2), np.float32)),
                                     ("b", np.zeros(3, np.float32))])
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    if edit:
        edit(header)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head + raw[8 + n:] + tail)
    return path


def _reference_refuses(path) -> None:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    with pytest.raises(SafetensorError):
        load_file(str(path))


def test_a_file_as_written_reads(tmp_path):
    start, header = read_safetensors_header(_file(tmp_path))
    assert sorted(header) == ["a", "b"] and start % 8 == 0


@pytest.mark.parametrize("edit,tail,needle", [
    (lambda h: h["b"].update(data_offsets=[28, 40]), b"", "starts at data byte 28, the one before "
                                                        "it ends at 32 (overlap)"),
    (lambda h: h["b"].update(data_offsets=[36, 48]), b"\0" * 8, "starts at data byte 36, the one "
                                                               "before it ends at 32 (gap)"),
    (None, b"\0" * 8, "the tensors end at byte"),
    (lambda h: h["a"].update(shape=[2, 4, 1, 1, 1]), b"", None),      # the same bytes: a reshape
    (lambda h: h["a"].update(shape=[4, 3]), b"", "tensor 'a' [4, 3] F32 spans 32 bytes"),
    (lambda h: h["b"].update(dtype="Q9"), b"", "dtype 'Q9', which is no safetensors dtype"),
    (lambda h: h["b"].update(shape=[-3]), b"", "tensor 'b' [-3] F32 spans"),
], ids=["overlap", "gap", "trailing-bytes", "reshape", "length", "dtype", "negative"])
def test_lengths_that_disagree_are_refused_as_the_library_refuses_them(tmp_path, edit, tail, needle):
    path = _file(tmp_path, edit, tail)
    if needle is None:
        read_safetensors_header(path)
        return
    with pytest.raises(OlmaxError, match=r"unreadable safetensors file") as e:
        read_safetensors_header(path)
    assert needle in str(e.value), e.value
    _reference_refuses(path)
