"""`make gpu-check`: everything the project checks on a GPU, in one command, one JSON and one report.

    python tools/gpu_check.py [--out out/gpu-check] [--append docs/benchmarks.md] [--quick]
                              [--sections tests,events,real,racecheck,overhead,pair,soc,thirdparty]
                              [--time-scale X]

Sections, each a subprocess under its own time limit (a section that fails or runs out of time is
recorded as such and the rest still run):

1. ``tests``: the ``gpu``-marked tests (``pytest -m gpu``).
2. ``events``: the live manager against PyTorch alone, per event source (python, native): none and
   lru at a budget above the peak (pure overhead), lru at 1/2, 1/4, 1/8 of it, plus torch's ``save_on_cpu``;
   step time, peak, host synchronizations per step, bit identity (deterministic algorithms).
3. ``real``: ``dynn bench --real`` at ``small`` for moe, varlen, evoformer at caps 1/2, 1/4, 1/8
   (hard cap), and at 1/4 as a logical budget: each policy against unlimited memory, ``torch.autograd.graph.save_on_cpu`` and
   ``torch.utils.checkpoint``, with the simulator's prediction of the same runs beside them.
4. ``racecheck``: ``compute-sanitizer --tool racecheck`` on a short managed run.
5. ``overhead``: ``dynn bench --overhead --device cuda`` (native events): the operator microbenchmark
   and every zoo family with the manager above the peak (none, lru, pilot) and lru at 1/2, timed with
   the GPU synchronized at each step's end; the simulator's host-cost calibration measured on this
   GPU is written into ``<out>/host_cost.json`` (a copy of the shipped file with ``devices.cuda``
   added: commit it as ``dynn_runtime/sim/host_cost.json``).
6. ``pair``: nothing moved (none, none with CUDA deaths swept for rather than heard, lru, pilot),
   paired step by step against PyTorch alone in one process
   (``tools/overhead_pair.py --device cuda``: two copies of each model, the steps alternating, wall
   time with the GPU synchronized around each side): the ratio the 1.05x target is about, with the
   noise of separate runs taken out.
7. ``soc``: the manager at the memory ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` reaches,
   against it, per zoo family (``tools/soc_match.py``: lru with each copy engine, and the pilot).
8. ``thirdparty``: the networks outside the zoo (``tools/third_party/evaluate.py --device cuda``):
   per network and method (the pilot shipped, with its fallback, adapted; replay; lru) at 1/4 of the
   peak, hits / misses / stalls / bytes moved, steps to recover, step time over PyTorch alone.

``--sections`` runs a subset (a device lease is short: split the check over calls); ``--time-scale``
multiplies every section's time limit.

Without CUDA every section says so and the command succeeds: the tests skip, the rest is skipped,
and nothing is appended. The report is written to ``<out>/gpu-check-<stamp>.json`` and ``.md`` and,
on a GPU, appended to ``--append``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

FAMILIES = ("moe", "varlen", "evoformer")
CAPS = ("1/2", "1/4", "1/8")
SECTIONS = ("tests", "events", "real", "racecheck", "overhead", "pair", "soc", "thirdparty")
PAIR_FAMILIES = ("moe", "skipnet", "early_exit", "tree_lstm", "evoformer", "varlen", "examples/my_workload.py:build")
ROOT = Path(__file__).resolve().parents[1]


def _run(cmd: list[str], timeout: float, env: dict | None = None) -> dict:
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = "timeout", (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
    return {"cmd": " ".join(cmd), "rc": rc, "seconds": round(time.perf_counter() - t0, 1), "tail": out[-4000:]}


def events_section(steps: int, fractions: list[float], out: Path) -> None:
    """Runs in a child process (``--section events``): none and lru per event source against PyTorch alone."""
    import torch

    from dynn_runtime.runtime.train import deterministic, train_managed, train_unmanaged

    rows = []
    with deterministic():
        for fam in FAMILIES:
            torch.cuda.reset_peak_memory_stats()
            base = train_unmanaged(fam, steps=steps, preset="small", device="cuda")
            t0, peak = base.median_step_seconds(), max(base.peak_bytes)
            rows.append(dict(family=fam, method="PyTorch alone", seconds=t0, ratio=1.0, peak=peak, identical=True,
                             reserved=torch.cuda.max_memory_reserved()))
            soc = train_unmanaged(fam, steps=steps, preset="small", device="cuda", label="save_on_cpu",
                                  step_context=lambda: torch.autograd.graph.save_on_cpu(pin_memory=True))
            rows.append(dict(family=fam, method="torch save_on_cpu", seconds=soc.median_step_seconds(),
                             ratio=soc.median_step_seconds() / t0, peak=max(soc.peak_bytes),
                             identical=soc.digest == base.digest))
            for ev in ("python", "native"):
                os.environ["DYNN_EVENTS"] = ev
                # none above the peak: every event source on, nothing moved (the 1.05x target)
                for policy, frac in [("none", None), ("lru", None), *(("lru", f) for f in fractions)]:
                    budget = 64 << 30 if frac is None else int(peak * frac)
                    label = f"{policy}, {ev} events, " + ("above the peak" if frac is None else f"1/{round(1 / frac)}")
                    torch.cuda.reset_peak_memory_stats()
                    try:
                        r = train_managed(fam, budget, policy, steps=steps, preset="small", device="cuda",
                                          hard_cap=frac is not None)
                    except Exception as e:  # noqa: BLE001 - recorded, the grid goes on
                        rows.append(dict(family=fam, method=label, error=f"{type(e).__name__}: {e}"[:700]))
                        continue
                    st = r.stats or {}
                    per = st.get("per_step", [])[1:]
                    rows.append(dict(
                        family=fam, method=label, seconds=r.median_step_seconds(), ratio=r.median_step_seconds() / t0,
                        peak=st.get("max_memory_allocated"), reserved=torch.cuda.max_memory_reserved(),
                        budget=None if frac is None else budget, storage_budget=st.get("budget_bytes"),
                        unmanaged=st.get("unmanaged_bytes"), outside_at_cap=st.get("outside_at_cap_bytes"),
                        identical=r.digest == base.digest, event_source=st.get("event_source"),
                        moved=st.get("bytes_offloaded"),
                        host_syncs_per_step=sum(s["host_syncs"] for s in per) / max(len(per), 1),
                        evictions_per_step=sum(s["evictions"] for s in per) / max(len(per), 1)))
                    print(json.dumps(rows[-1]), flush=True)
    out.write_text(json.dumps(rows, indent=1))


def _fmt_events(rows: list[dict]) -> list[str]:
    lines = ["| family | method | step | x alone | hard cap | peak allocated / reserved | host syncs / step | "
             "evictions / step | bit-identical |", "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['family']} | {r['method']} | failed: {r['error'][:160]} | | | | | | |")
            continue
        peak = "" if r.get("peak") is None else f"{r['peak'] / 2**20:.1f} / {(r.get('reserved') or 0) / 2**20:.1f} MiB"
        cap = "" if r.get("budget") is None else f"{r['budget'] / 2**20:.1f} MiB"
        syncs = "" if r.get("host_syncs_per_step") is None else f"{r['host_syncs_per_step']:.1f}"
        ev = "" if r.get("evictions_per_step") is None else f"{r['evictions_per_step']:.1f}"
        lines.append(f"| {r['family']} | {r['method']} | {r['seconds'] * 1e3:.1f} ms | {r['ratio']:.2f}x | {cap} | {peak} "
                     f"| {syncs} | {ev} | {'yes' if r['identical'] else 'NO'} |")
    return lines


def overhead_section(py: str, out: Path, quick: bool, limit) -> dict:
    """``dynn bench --overhead --device cuda`` into ``out``; the calibration goes into a copy of the
    shipped calibration file there, so that the CPU's figures stay beside the GPU's."""
    from dynn_runtime.sim.hostcost import CALIBRATION_PATH

    cal = out / "host_cost.json"
    shutil.copyfile(CALIBRATION_PATH, cal)
    oj = out / "overhead.json"
    # `small` either way: the calibration is charged to the simulator's `small` and larger runs
    args = ["--preset", "small", "--steps", "2" if quick else "3", "--reps", "9" if quick else "15"]
    run = _run([py, "-m", "dynn_runtime.cli", "bench", "--overhead", "--device", "cuda", "--events", "native", *args,
                "--json", str(oj), "--write-calibration", str(cal), "-q"], limit(240))
    run["markdown"] = oj.with_suffix(".md").read_text() if oj.with_suffix(".md").exists() else ""
    run["calibration"] = str(cal) if run["rc"] == 0 else None
    return run


def thirdparty_section(py: str, out: Path, steps: int, limit) -> dict:
    """The networks outside the zoo, live on the GPU (tools/third_party/evaluate.py --device cuda)."""
    tj = out / "thirdparty.json"
    run = _run([py, str(ROOT / "tools" / "third_party" / "evaluate.py"), "--device", "cuda", "--steps", str(steps),
                "--no-trace", "--json", str(tj)], limit(180))
    run["results"] = json.loads(tj.read_text())["results"] if tj.exists() else {}
    return run


def _gpu_sections(a: argparse.Namespace, want: set[str], sec: dict, say, out: Path, steps: int, limit) -> None:
    """Sections 2-6 (CUDA only), each a subprocess under ``limit(seconds)``."""
    py = sys.executable
    if "events" in want:
        say("2/8 event sources against PyTorch alone")
        ev = out / "events.json"
        sec["events"] = _run([py, __file__, "--section", "events", "--out", str(out), "--steps", str(steps)]
                             + (["--quick"] if a.quick else []), limit(150))
        sec["events"]["rows"] = json.loads(ev.read_text()) if ev.exists() else []
    if "real" in want:
        sec["real"] = {"runs": []}

        def real(args: list[str], rj: Path, timeout: float) -> None:
            run = _run([py, "-m", "dynn_runtime.cli", "bench", "--real", *args, "--json", str(rj), "--out", str(out),
                        "-q"], limit(timeout), env={"DYNN_EVENTS": "native"})
            run["markdown"] = run.pop("tail").split("\nwrote ")[0][-6000:] if run["rc"] == 0 else run.pop("tail")
            run["results"] = json.loads(rj.read_text())["results"] if rj.exists() else []
            sec["real"]["runs"].append(run)

        # hard caps at each fraction, then 1/4 as a logical budget (at `small` sizes the allocator's
        # segments and workspaces decide hard caps; the logical run compares the policies themselves)
        for cap, hard in [(c, True) for c in (["1/4"] if a.quick else CAPS)] + [("1/4", False)]:
            say(f"3/8 dynn bench --real at {cap} ({'hard cap' if hard else 'logical budget'}, native events)")
            rj = out / f"real-{cap.replace('/', 'of')}{'' if hard else '-logical'}.json"
            real(["--families", *FAMILIES, "--cap", cap, "--policies", "lru", "save_on_cpu", "pilot", "--steps",
                  str(max(3, steps - 1)), "--max-scale", "0"] + ([] if hard else ["--no-hard-cap"]), rj, 110)
        if not a.quick:
            # moe `large` does not fit an 80 GB H100 alone: the manager measures its peak in a first step
            # under the device's free memory and trains at a quarter of it
            say("3/8 dynn bench --real: moe large, which PyTorch alone cannot train here, at 1/4 (native events)")
            rj = out / "real-large-moe.json"
            real(["--families", "moe", "--preset", "large", "--cap", "1/4", "--policies", "lru", "--steps", "3",
                  "--max-scale", "0", "--no-predict"], rj, 170)
    if "racecheck" in want:
        say("4/8 compute-sanitizer --tool racecheck on a short managed run")
        san = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
        if Path(san).exists():
            code = ("from dynn_runtime.runtime.train import train_managed as t;"
                    "r = t('moe', '1/2', 'lru', steps=3, preset='tiny', device='cuda');"
                    "print('moved', r.stats['bytes_offloaded'])")
            sec["racecheck"] = _run([san, "--tool", "racecheck", "--racecheck-report", "hazard", py, "-c", code],
                                    limit(150), env={"DYNN_EVENTS": "native"})
        else:
            sec["racecheck"] = {"rc": "skipped", "why": "compute-sanitizer not found"}
    if "overhead" in want:
        say("5/8 dynn bench --overhead --device cuda (the simulator's host cost measured on this GPU)")
        sec["overhead"] = overhead_section(py, out, a.quick, limit)
    if "pair" in want:
        say("6/8 nothing moved, paired step by step with PyTorch alone (tools/overhead_pair.py)")
        fams = PAIR_FAMILIES[3:5] if a.quick else PAIR_FAMILIES
        sec["pair"] = _run([py, str(ROOT / "tools" / "overhead_pair.py"), ",".join(fams), "--device", "cuda",
                            "--steps", "8" if a.quick else "12", "--configs", "none,none-swept,lru,pilot"],
                           limit(200))
    if "soc" in want:
        say("7/8 the manager at the memory save_on_cpu reaches (tools/soc_match.py)")
        sj = out / "soc.json"
        sec["soc"] = _run([py, str(ROOT / "tools" / "soc_match.py"), *(["tree_lstm", "evoformer"] if a.quick else []),
                           "--steps", "5" if a.quick else "6", "--rounds", "1" if a.quick else "2", "--policies",
                           "lru,lru-pycopies,pilot", "--json", str(sj)],
                          limit(150))
    if "thirdparty" in want:
        say("8/8 networks outside the zoo, live on the GPU (tools/third_party/evaluate.py --device cuda)")
        sec["thirdparty"] = thirdparty_section(py, out, max(4, steps), limit)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="out/gpu-check")
    ap.add_argument("--append", default="docs/benchmarks.md", help="report appended here ('' for none)")
    ap.add_argument("--quick", action="store_true", help="fewer steps, caps 1/4 only (a smoke run)")
    ap.add_argument("--section", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)")
    ap.add_argument("--time-scale", type=float, default=1.0, help="multiplies every section's time limit")
    a = ap.parse_args()
    want = set(a.sections.split(","))
    unknown = want - set(SECTIONS)
    if unknown:
        ap.error(f"--sections: unknown {sorted(unknown)}; expected a subset of {','.join(SECTIONS)}")

    def limit(seconds: float) -> float:
        return seconds * a.time_scale

    steps = a.steps or (3 if a.quick else 5)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.section == "events":
        events_section(steps, [0.25] if a.quick else [0.5, 0.25, 0.125], out / "events.json")
        return 0

    import torch

    t_all = time.perf_counter()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    py = sys.executable
    cuda = torch.cuda.is_available()
    report: dict = {"kind": "dynn-gpu-check", "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "torch": torch.__version__,
                    "device": torch.cuda.get_device_name() if cuda else "none (CUDA not available)", "sections": {},
                    "args": "".join(f" {x}" for x in sys.argv[1:])}
    sec = report["sections"]

    js = out / f"gpu-check-{stamp}.json"

    def say(text: str) -> None:
        report["wall_s"] = round(time.perf_counter() - t_all, 1)
        js.write_text(json.dumps(report, indent=1))  # what ran so far survives a kill
        print(f"gpu-check [{time.perf_counter() - t_all:5.0f} s] {text}", file=sys.stderr, flush=True)

    if "tests" in want:
        say("1/8 gpu-marked tests")
        sec["tests"] = _run([py, "-m", "pytest", "-q", "-m", "gpu", "tests", "-p", "no:cacheprovider"], limit(240))
    if not cuda:
        for name in SECTIONS[1:]:
            if name in want:
                sec[name] = {"rc": "skipped", "why": "CUDA is not available"}
    else:
        _gpu_sections(a, want, sec, say, out, steps, limit)
    report["wall_s"] = round(time.perf_counter() - t_all, 1)
    js.write_text(json.dumps(report, indent=1))
    md = render(report)
    (out / f"gpu-check-{stamp}.md").write_text(md)
    append = a.append if cuda else ""  # figures only from a GPU go to the benchmarks
    if append:
        with open(append, "a") as f:
            f.write("\n" + md)
    print(md)
    print(f"wrote {js}" + (f" and appended to {append}" if append else ""))
    bad = [k for k, v in sec.items() if k != "real" and v.get("rc") not in (0, "skipped")]
    bad += [f"real {i}" for i, r in enumerate(sec.get("real", {}).get("runs", [])) if r["rc"] != 0]
    if bad:
        print(f"gpu-check: failed sections: {', '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0


def render(report: dict) -> str:
    sec = report["sections"]
    lines = [f"## make gpu-check: {report['device']}, torch {report['torch']} ({report['date']})", "",
             f"`make gpu-check{report.get('args', '')}`, {report['wall_s']:.0f} s end to end.", ""]
    t = sec.get("tests")
    if t:
        last = [ln for ln in t.get("tail", "").strip().splitlines() if ln.strip()][-1:] or ["?"]
        lines += [f"**gpu-marked tests** (`pytest -m gpu`): {last[0].strip('= ')} ({t.get('seconds', 0):.0f} s)", ""]
    ev = sec.get("events", {})
    if ev.get("rows"):
        lines += ["**Event sources** (lru, `small`, median step without the first, hard cap at the fractions; "
                  "bit identity against PyTorch alone under deterministic algorithms):", ""]
        lines += _fmt_events(ev["rows"]) + [""]
    elif ev:
        lines += [f"**Event sources**: {ev.get('rc')} {ev.get('why', '')}{ev.get('tail', '')[-800:]}", ""]
    for run in sec.get("real", {}).get("runs", []):
        if run["rc"] == 0:
            body = run["markdown"].replace("\n# dynn bench", "\n### dynn bench").replace("\n## ", "\n#### ")
            lines += [body.lstrip().replace("# dynn bench", "### dynn bench", 1), ""]
        else:
            lines += [f"`{run['cmd']}`: rc {run['rc']} after {run['seconds']} s", "", "```",
                      run.get("tail", run.get("markdown", ""))[-1500:], "```", ""]
    rc = sec.get("racecheck", {})
    if rc:
        tail = [ln for ln in rc.get("tail", "").splitlines() if "RACECHECK SUMMARY" in ln or "ERROR SUMMARY" in ln]
        lines += [f"**racecheck** (`compute-sanitizer --tool racecheck`, moe tiny, lru at 1/2, 3 steps): "
                  f"rc {rc.get('rc')}, {rc.get('seconds', '')} s; {'; '.join(tail) or rc.get('why', '')}", ""]
        if rc.get("rc") not in (0, "skipped"):
            lines += ["```", rc.get("tail", "")[-1500:], "```", ""]
    ov = sec.get("overhead", {})
    if ov:
        lines += [f"**dynn bench --overhead --device cuda** (native events): rc {ov.get('rc')}, "
                  f"{ov.get('seconds', '')} s{'; ' + ov['why'] if ov.get('why') else ''}"
                  + (f"; calibration written to `{ov['calibration']}`" if ov.get("calibration") else ""), ""]
        if ov.get("markdown"):
            lines += [ov["markdown"].replace("\n# dynn", "\n### dynn").replace("\n## ", "\n#### ")
                      .replace("# dynn bench", "### dynn bench", 1), ""]
        if ov.get("rc") not in (0, "skipped"):
            lines += ["```", ov.get("tail", "")[-1500:], "```", ""]
    pair = sec.get("pair", {})
    if pair:
        rows = [ln for ln in pair.get("tail", "").splitlines() if " round " in ln]
        lines += [f"**Paired with PyTorch alone step by step** (`tools/overhead_pair.py --device cuda`, median of the "
                  f"per-step ratios without the first two steps): rc {pair.get('rc')}, {pair.get('seconds', '')} s", "",
                  "```", *(rows or [pair.get("tail", "")[-1500:]]), "```", ""]
    soc = sec.get("soc", {})
    if soc:
        table = soc.get("tail", "").split("\nfamily | method", 1)
        lines += [f"**At the memory `save_on_cpu` reaches** (`tools/soc_match.py`): rc {soc.get('rc')}, "
                  f"{soc.get('seconds', '')} s", "", "```",
                  ("family | method" + table[1]).strip() if len(table) == 2 else soc.get("tail", "")[-1500:], "```", ""]
    tp = sec.get("thirdparty", {})
    if tp:
        lines += [f"**Networks outside the zoo, live** (`tools/third_party/evaluate.py --device cuda`): rc "
                  f"{tp.get('rc')}, {tp.get('seconds', '')} s{'; ' + tp['why'] if tp.get('why') else ''}", ""]
        if tp.get("results"):
            lines += [_thirdparty_table(tp["results"]), ""]
        if tp.get("rc") not in (0, "skipped"):
            lines += ["```", tp.get("tail", "")[-1500:], "```", ""]
    return "\n".join(lines)


def _thirdparty_table(results: dict) -> str:
    """The evaluation's own table (tools/third_party/evaluate.py), PyTorch alone's step time before it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("third_party_evaluate", ROOT / "tools" / "third_party" / "evaluate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    alone = ", ".join(f"{n} {r['live']['alone_step_s'] * 1e3:.1f} ms" for n, r in results.items())
    return f"PyTorch alone per step: {alone}.\n\n" + mod.table(results)


if __name__ == "__main__":
    raise SystemExit(main())
