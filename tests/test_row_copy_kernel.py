"""`copy_rows` (the graph capture's activation copy) against its torch reference.

Without CUDA the kernel runs on CPU under Triton's interpreter (the whole module reruns in a
child process when another module imported Triton first, as in test_attention_kernels.py)."""

from __future__ import annotations

import pytest
import torch

from _triton_interpret import import_kernels, interpreter_hooks, is_interpreted, library_is_compiled

(row_copy,) = import_kernels(("flexserve_kernels.row_copy",),
                             interpret=not torch.cuda.is_available())
INTERPRETED = is_interpreted(row_copy._copy_rows_kernel)
DEVICE = "cpu" if INTERPRETED else "cuda"
RUN_IN_CHILD = INTERPRETED and library_is_compiled()

test_module_in_interpreter_child_process, _triton_interpret = interpreter_hooks(
    __file__, INTERPRETED, RUN_IN_CHILD)


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.float32, torch.float16),
                                    (torch.float16, torch.float16)])
@pytest.mark.parametrize("width", [5, 1024, 1500])
def test_copy_rows_matches_reference_and_leaves_other_rows(dtypes, width):
    src_dtype, dst_dtype = dtypes
    g = torch.Generator().manual_seed(width)
    wide = torch.randn(40, width + 7, generator=g).to(src_dtype).to(DEVICE)
    src = wide[:, 3:]  # a column slice: strided rows, 7 - 3 extra columns past the copied ones
    dst = torch.randn(30, width, generator=g).to(dst_dtype).to(DEVICE)
    src_index = torch.randperm(40, generator=g)[:16].to(DEVICE)
    dst_index = torch.randperm(30, generator=g)[:16].to(DEVICE)
    count = torch.tensor([11], dtype=torch.int32, device=DEVICE)  # the last 5 entries: padding
    expected = row_copy.copy_rows_ref(dst.clone(), dst_index, src, src_index, count)
    got = row_copy.copy_rows(dst.clone(), dst_index, src, src_index, count)
    assert torch.equal(got.cpu(), expected.cpu())
    untouched = torch.ones(30, dtype=torch.bool)
    untouched[dst_index[:11].cpu()] = False
    assert torch.equal(got.cpu()[untouched], dst.cpu()[untouched])


def test_copy_rows_rejects_bad_shapes():
    a = torch.zeros(4, 8, device=DEVICE)
    index = torch.zeros(2, dtype=torch.long, device=DEVICE)
    count = torch.ones(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="at least as wide"):
        row_copy.copy_rows(a, index, a[:, :4], index, count)
    with pytest.raises(ValueError, match="one length"):
        row_copy.copy_rows(a, index, a, index[:1], count)
