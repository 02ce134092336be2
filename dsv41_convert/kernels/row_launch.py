"""Launch geometry shared by the row-wise activation quantizers (act_quant, fp4_act_quant): plain Python,
evaluated on the host when a kernel is specialised or launched."""


def vector_width(c: int, group: int, elem_bytes: int) -> int:
    """Largest power-of-two vector (<= 16 bytes) dividing both the row length `c` and the group."""
    v = 16 // elem_bytes
    while c % v or group % v:
        v //= 2
    return v


def rows_per_launch(c: int, group: int) -> int:
    """Rows per launch that keep every int32 slot index in range (huge tensors go in slices)."""
    vpr = -(-c // group) * (group // vector_width(c, group, 2))
    return max(1, (2**31 - 2**20) // vpr)
