"""`plan --json` as text: each output tensor's entry written directly, the same bytes as json.dumps of
ConversionPlan.to_dict()'s entry (compact separators, ASCII escapes). The real checkpoint's plan has 107k
tensors, and building their 400k dicts and lists for the encoder cost more than writing the text.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from dsv41_convert.store.safetensors_header import JSON_PLAIN


def quote(text: str) -> str:
    """`text` as json.dumps writes it (ASCII escapes)."""
    return f'"{text}"' if JSON_PLAIN.fullmatch(text) else json.dumps(text)


_quote_few = functools.cache(quote)  # files, dtypes, rules, actions: a few dozen values, quoted 107k times


def tensor_json(t: Any) -> str:  # t: plan.OutTensor (plan imports this module)
    """json.dumps(plan._tensor_summary(t), separators=(",", ":")): the entry to_dict() gives `t`, without the dicts."""
    name = quote(t.name)
    reads = []
    for r in t.reads:
        cols = "" if r.c1 < 0 else f',"cols":[{r.c0},{r.c1}]'
        rname = name if r.name == t.name else quote(r.name)  # most reads are of the tensor's own name
        reads.append(f'{{"file":{_quote_few(r.file)},"name":{rname},"rows":[{r.r0},{r.r1}]{cols}}}')
    return (
        f'{{"name":{name},"dtype":{_quote_few(t.dtype)},"shape":[{_dims(t.shape)}],"rule":{_quote_few(t.rule)},'
        f'"action":{_quote_few(t.action)},"reads":[{",".join(reads)}]}}'
    )


def run_json(run: Any) -> str:  # run: plan.ExpertRun
    """`",".join(map(tensor_json, run.tensors()))`, without the OutTensors: a member's entry differs from the
    next only in its name and source (file, name, rows)."""
    head = f'"dtype":{_quote_few(run.dtype)},"shape":['
    tail = f'],"rule":{_quote_few(run.rule)},"action":{_quote_few(run.action)},"reads":[{{"file":'
    plain = JSON_PLAIN.fullmatch("".join(name + s.name for name, s in run.members)) is not None
    dims = {shape: _dims(out) for shape, out in run.out_shapes().items()}
    entries = []
    for name, s in run.members:
        name_q = f'"{name}"' if plain else quote(name)
        read_q = name_q if s.name == name else (f'"{s.name}"' if plain else quote(s.name))
        entries.append(
            f'{{"name":{name_q},{head}{dims[s.shape]}{tail}{_quote_few(s.file)},"name":{read_q},"rows":[0,{s.shape[0]}]}}]}}'
        )
    return ",".join(entries)


@functools.cache
def _dims(shape: tuple[int, ...]) -> str:
    """A shape as a JSON list's inside: a few hundred shapes, written 107k times."""
    return ",".join(map(str, shape))
