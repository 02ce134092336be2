"""Rich renderables of a VerifyResult, for cli.py to print (this module prints nothing)."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from dsv41_convert.numbers import counted
from dsv41_convert.verify.metrics import Stats
from dsv41_convert.verify.run import VerifyResult
from dsv41_convert.verify.thresholds import SECTIONS

COLUMNS = ("prompt", "vs", "what", "rows", "top1", "KL mean", "KL max", "cos min", "max|d|")


def _row(table: Table, prompt: str, vs: str, section: str, s: Stats, bad: bool) -> None:
    style = "red" if bad else None
    table.add_row(
        Text(prompt), vs, section, str(s.rows), f"{s.top1:.2f}", f"{s.kl_mean:.2g}", f"{s.kl_max:.2g}",
        f"{s.cos_min:.4f}", f"{s.max_abs:.2g}", style=style,
    )  # fmt: skip


def render(result: VerifyResult) -> Group:
    """A metrics table (per prompt, then overall; against the tp-1 reference and the twin), then the
    verdict, the failures and the localization."""
    title = f"verify {result.converted} (tp {result.tp}, {result.device}) vs {result.reference}"
    title += f"  [{result.thresholds.mode}]"
    table = Table(
        title=Text(title),  # paths and the mode in brackets, printed as they are (no markup)
        title_justify="left",
        caption="ref: against the reference; twin: against the converter's expected output on the same ranks",
    )
    for col in COLUMNS:
        if col in ("prompt", "vs", "section"):
            table.add_column(col, justify="left", overflow="fold")
        else:
            table.add_column(col, justify="right", no_wrap=True)
    for p in result.prompts:
        for vs, sections in (("ref", p.sections), ("twin", p.twin)):
            for key in SECTIONS:
                if key in sections:
                    bad = any(f.startswith(f"{'twin ' if vs == 'twin' else ''}{key}:") for f in p.failures)
                    _row(table, p.label, vs, key, sections[key], bad)
    for vs, overall in (("ref", result.overall), ("twin", result.twin)):
        for key in SECTIONS:
            if key in overall:
                prefix = "twin " if vs == "twin" else ""
                bad = any(f.startswith(f"{prefix}{key}:") for f in result.failures)
                _row(table, "overall", vs, key, overall[key], bad)
    parts: list = [table]
    style = {"PASS": "bold green", "FAIL": "bold red"}.get(result.verdict, "bold yellow")
    if result.verdict == "FAIL":  # a decisive check may hold beside a failure of another kind (tokenizer, replicas)
        held = f"; held: {', '.join(result.held)}, but the failures below decide" if result.held else ""
        how = f"{counted(len(result.failures), 'failure')}{held}"
    elif result.verdict == "PASS" and result.decisive:
        how = "decisive: " + ", ".join(f"{name} bit for bit" for name in result.decisive)
        if result.drafts_statistical:
            how += "; the DSpark drafts on statistical bounds only (--statistical)"
        if result.drafts_unchecked:
            how += "; the DSpark drafts compared by nothing (no decode steps), accepted by --statistical"
    elif result.verdict == "PASS":
        how = "statistical bounds only (--statistical)" + _bounded_held(result)
        if result.drafts_unchecked:
            how += "; the DSpark drafts compared by nothing (no decode steps)"
    elif result.held:  # INCONCLUSIVE: bit for bit, but the DSpark stages were compared by nothing
        how = f"held bit for bit: {', '.join(result.held)}, but no check compared the DSpark drafts"
    else:
        how = "no decisive check held" + _bounded_held(result)
    parts.append(Text.assemble(Text(result.verdict, style=style), f"  mode {result.thresholds.mode}; {how}"))
    for c in result.checks:
        mark = "exact" if c.exact else "differs" if c.failures or c.expected_exact else "held, not bit for bit"
        parts.append(Text(f"  check {c.name}: {mark} ({c.note})", style="dim" if not c.failures else "red"))
    for f in result.failures:
        parts.append(Text(f"  {f}", style="red"))
    if result.advice:
        parts.append(Text(f"  {result.advice}", style="yellow"))
    compared = result.weights in ("held", "differs") or any(c.name == "twin" for c in result.checks)
    for part in result.unreached:
        if compared:  # its weights' bytes were compared; what they compute was not
            parts.append(Text(f"  no prompt runs it (its weights compared byte for byte): {part}", style="dim"))
        else:
            parts.append(Text(f"  not checked, no prompt runs it: {part}", style="yellow"))
    if result.weights_note:
        style = {"differs": "red", "held": "dim"}.get(result.weights, "yellow")  # partial, not recorded: yellow
        parts.append(Text(f"  weights: {result.weights} ({result.weights_note})", style=style))
    if result.config_note:
        parts.append(Text(f"  config: {result.config} ({result.config_note})", style="yellow"))
    if result.manifest == "absent":
        parts.append(Text("  no manifest.json: the files were not checked against a record of them", style="dim"))
    elif result.manifest == "another set":
        parts.append(
            Text("  manifest.json records another tp's rank files: these were not checked against it", style="dim")
        )
    loc = result.localization
    if loc is not None:
        if loc.module:
            parts.append(Text(f"first diverging module: {loc.module}", style="bold"))
        for t in loc.tensors[:12]:
            where = f" (ranks {', '.join(map(str, t.ranks))})" if t.ranks else ""
            parts.append(Text(f"  tensor {t.name}{where}: {t.what}"))
        if len(loc.tensors) > 12:
            parts.append(Text(f"  ... and {len(loc.tensors) - 12} more tensors"))
        if loc.note:
            parts.append(Text(f"  note: {loc.note}", style="dim"))
    return Group(*parts)


def _bounded_held(result: VerifyResult) -> str:
    """ "; the teacher check held within its bound ..." where it did: evidence, not proof (verify.verdict)."""
    if any(c.name == "teacher" and not c.failures and not c.exact for c in result.checks):
        return "; the teacher check held within its measured noise bound, which is evidence, not proof"
    return ""
