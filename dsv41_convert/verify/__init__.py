"""`dsv41-convert verify`: run converted weights on every rank and compare their logits with a reference.

prompts.py     built-in and JSONL prompts
runner.py      one prompt through the model: prefill, decode steps, DSpark drafts, hidden states
source.py      the source checkpoint transformed in memory (the engine's plan + transform), whole or per rank
reference.py   reference outputs from the source: at tp 1 in this process, or on N ranks
reffile.py     the reference-logits file format
twin.py        the converter's expected output cut into ranks, for a bit-exact like-for-like run
launch.py      one process per rank: spawn, or join torchrun
process_group.py  a torchrun process in its launch's group; what torch.distributed's exceptions say
rank_failures.py  why the spawned ranks failed: their error files read back, the rank that hung named
ranks.py       the per-rank body: load, run the twin and the converted files
metrics.py     top-1, KL, cosine, max abs diff
replay.py      the rank files merged back to tp 1 (convert.unshard) and run against a tp-1 reference
thresholds.py  statistical bounds per mode
verdict.py     PASS / FAIL / INCONCLUSIVE: which checks are decisive, what blocks bit equality
localize.py    the first diverging module and the differing tensors
run.py         the whole check
table.py       the rich table for the CLI
roundtrip.py   two checkpoints of one format tensor by tensor: same bytes, same values (and why), or not

May import `model`, `convert` (the plan and transforms of the source, run in memory), `store`, `quant`,
`config`, `errors`; never the CLI.
"""
