"""The converter: from a checkpoint's headers to per-rank files.

Owns the one table of tensor rules (`rules`), the tensors a config implies (`catalogue`), the header-only
plan and its validation (`plan`, `validate`; `plan_json` writes its --json text), the per-tensor
transforms (`transform`), the streaming execution of a plan (`execute`, `write`; computed tensors in row
blocks: `stream`, their source read ahead: `prefetch`), and its inverse, rank files merged back to tp 1
in memory (`unshard`). May import `quant`, `store`, `config`, `errors`, `progress`; never `model`,
`verify`, `synth`, `hub` or the CLI.
"""
