"""The names of routed-expert tensors, `layers.{i}.ffn.experts.{e}.*` and `mtp.{i}.ffn.experts.{e}.*`: the one
pattern the conversion rules and the model's loader both read."""

from __future__ import annotations

import re

# groups: layer ("layers.3", "mtp.0"), stack ("layers" or "mtp"), expert (the id, decimal)
ROUTED_EXPERT = re.compile(r"(?P<layer>(?P<stack>layers|mtp)\.\d+)\.ffn\.experts\.(?P<expert>\d+)\.")
