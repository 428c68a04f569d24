"""What every op shares: dispatch and argument checks (`dispatch`), page tables (`pagetable`), the GQA
combination of per-query-head page scores (`gqa`) and the small Triton pieces the kernels reuse
(`triton_utils`, importable only where Triton is)."""
