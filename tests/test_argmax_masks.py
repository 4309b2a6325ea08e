"""The argmax a small CPU decode step's C call takes for every row (tandem_argmax_masked_rows_f32): a row
with a grammar's mask in the step's table gets fused.masked_argmax's pick under it (0 where the mask allows
nothing, as the engine's greedy_allowed gives), a row without one (NULL) torch.argmax's, NaN first."""

from __future__ import annotations

import ctypes

import torch
from test_structured import _words

from kernels import fused, native_cpu


def test_each_row_takes_its_argmax_under_its_own_mask_or_none():
    lib = native_cpu.library()
    assert lib is not None, "the CPU kernels did not build"
    gen = torch.Generator().manual_seed(0)
    vocab = 150  # 5 words, the last partly used
    for trial in range(200):
        x = torch.randint(0, 6, (5, vocab), generator=gen).float()
        if trial % 4 == 0:
            x[1, int(torch.randint(0, vocab, (1,), generator=gen))] = float("nan")  # a free row: NaN wins
        x[3] = float("-inf")  # allowed tokens all -inf: the first allowed one
        allowed = [set(torch.randperm(vocab, generator=gen)[:int(n)].tolist())
                   for n in torch.randint(1, vocab, (5,), generator=gen)]
        allowed[4] = set()  # nothing allowed: 0
        words = _words(allowed, vocab)
        masked_rows = [0, 2, 3, 4]
        table = (ctypes.c_void_p * 5)(*[words[r].data_ptr() if r in masked_rows else None for r in range(5)])
        best = (ctypes.c_int64 * 5)()
        lib.tandem_argmax_masked_rows_f32(x.data_ptr(), 5, vocab, table, words.shape[1], best, 1)
        expect = [max(fused.masked_argmax(x, [r], words[r:r + 1], vocab)[0], 0) if r in masked_rows
                  else int(x[r].argmax()) for r in range(5)]
        assert best[:] == expect
        assert best[3] == min(allowed[3]) and best[4] == 0
    free = (ctypes.c_int64 * 5)()
    lib.tandem_argmax_masked_rows_f32(x.data_ptr(), 5, vocab, None, 0, free, 1)  # no table: every row free
    assert free[:] == [int(r.argmax()) for r in x]  # torch.argmax: the first NaN, a row all -inf 0
