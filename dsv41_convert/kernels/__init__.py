"""TileLang CUDA kernels, one op a file, each beside its torch reference (quant/ for quantizers,
`ref.py` for the model's gemms, sparse attention and Sinkhorn); `dispatch.py` picks the kernel or the
reference per device.

May import `quant` and `errors` only; TileLang itself only through `tl.py`.
"""
