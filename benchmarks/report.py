"""The suite's results as text: console lines, results.md, results.json and ratios.png."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def _f(value: Any, fmt: str = ".2f", missing: str = "—") -> str:
    return missing if value is None else format(value, fmt)


def header(info: dict[str, Any]) -> str:
    peaks = ", ".join(f"{isa} {g:.0f}" for isa, g in info["peak_gflops_one_core"].items())
    load = ", ".join(f"{x:.2f}" for x in info["load_average_start"])
    return (f"{info['cpu']}, {info['cores']} cores; fp32 peak of one core (GFLOP/s): {peaks}\n"
            f"onnxruntime {info['onnxruntime']}, cuvil {info['cuvil']}, python {info['python']}; "
            f"torch {'present' if info['torch'] else 'absent: fallback models'}; load average {load}")


def _gflops(stats: dict[str, Any] | None) -> str:
    if not stats:
        return "—"
    fraction = stats.get("peak_fraction")
    return f"{stats['gflops']:.1f}" + (f" ({100 * fraction:.0f}%)" if fraction is not None else "")


def run_line(model: str, row: dict[str, Any]) -> str:
    c, o = row.get("cuvil"), row["ort"]
    ours = f"{c['median_ms']:9.3f} ms" if c else "        — ms"
    return (f"  {model:<22} t{row['threads']} b{row['batch']:<2} cuvil {ours}  onnxruntime "
            f"{o['median_ms']:9.3f} ms  ratio {_f(row.get('ratio'))}  GFLOP/s {_gflops(c)} vs {_gflops(o)}")


def model_line(result: dict[str, Any]) -> str:
    parts = [f"{result['model']}: "]
    if "build_s" in result:
        parts.append(f"built in {result['build_s']:.1f} s, wheel {result['wheel_kb']:.0f} KB; ")
    fresh = result.get("fresh", {})
    for engine in ("cuvil", "ort"):
        if engine in fresh:
            f = fresh[engine]
            parts.append(f"{engine} first result {f['first_result_ms']:.0f} ms (import + load "
                         f"{f['import_load_ms']:.1f}, first run {f['first_run_ms']:.1f}), "
                         f"peak RSS {f['peak_rss_mb']:.0f} MB; ")
    if "error" in result:
        parts.append(f"ERROR {result['error']}")
    return "".join(parts)


def geomeans(results: list[dict[str, Any]]) -> dict[int, tuple[float, int]]:
    """Geometric mean of cuvil / onnxruntime per thread count, over every model and batch."""
    by_threads: dict[int, list[float]] = {}
    for result in results:
        for row in result["runs"]:
            if row.get("ratio"):
                by_threads.setdefault(row["threads"], []).append(row["ratio"])
    return {t: (math.exp(sum(map(math.log, r)) / len(r)), len(r)) for t, r in sorted(by_threads.items())}


def geomeans_text(results: list[dict[str, Any]]) -> str:
    return "\n".join(f"geomean ratio cuvil/onnxruntime at {t} thread{'s' if t > 1 else ''}: {g:.2f} "
                     f"(over {n} model x batch runs)" for t, (g, n) in geomeans(results).items())


def markdown(info: dict[str, Any], results: list[dict[str, Any]]) -> str:
    lines = ["# cuvil vs onnxruntime", "", header(info).replace("\n", "  \n"),
             f"load average at the end {', '.join(f'{x:.2f}' for x in info['load_average_end'])}"
             + ("; --quick run (short budgets)" if info["quick"] else ""), "",
             ("Latency: median (IQR) of interleaved calls in one process, same inputs. Ratio < 1: cuvil "
             "is faster. GFLOP/s in brackets: share of the fp32 peak of that many cores (best ISA)."), "",
             ("| model | threads | batch | GFLOP | cuvil ms | onnxruntime ms | ratio | cuvil GFLOP/s | "
             "onnxruntime GFLOP/s | max rel diff |"),
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for result in results:
        for row in result["runs"]:
            c, o = row.get("cuvil"), row["ort"]
            gflop = f"{row['gflop']:.3g}" + ("" if row["gflop_complete"] else "+")
            lines.append(
                f"| {result['model']} | {row['threads']} | {row['batch']} | {gflop} | "
                + (f"{c['median_ms']:.3f} ({c['iqr_ms']:.3f})" if c else "—")
                + f" | {o['median_ms']:.3f} ({o['iqr_ms']:.3f}) | {_f(row.get('ratio'))} | {_gflops(c)} | "
                f"{_gflops(o)} | {_f(row.get('max_rel_diff'), '.1e')} |")
    lines += ["", ("Per model: `cuvil build` wall time, wheel and library size, and fresh processes "
              "(launch -> import + load + first run at batch 1; peak RSS: VmHWM). "
              "cuvil's process imports the unpacked wheel alone, without cuvil. *import + first "
              "run*: the engine's part of the first result, after the interpreter has started and "
              "read the inputs with numpy; right after `import numpy`, and *numpy idle*: once "
              "numpy's BLAS threads, which spin for about 0.1 s after the import, have stopped."), "",
              ("| model | source | build s | wheel KB | library KB | first result ms cuvil / ort | "
              "import + first run ms cuvil / ort (ratio) | the same, numpy idle | "
              "peak RSS MB cuvil / ort | error |"),
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for result in results:
        fresh = result.get("fresh", {})
        first = " / ".join(_f(fresh.get(e, {}).get("first_result_ms"), ".0f") for e in ("cuvil", "ort"))
        rss = " / ".join(_f(fresh.get(e, {}).get("peak_rss_mb"), ".0f") for e in ("cuvil", "ort"))
        error = " ".join(result.get("error", "").split()).replace("|", "\\|")
        lines.append(f"| {result['model']} | {result.get('source', '—')} | "
                     f"{_f(result.get('build_s'), '.1f')} | {_f(result.get('wheel_kb'), '.0f')} | "
                     f"{_f(result.get('library_kb'), '.0f')} | {first} | "
                     f"{_start_up(fresh)} | {_start_up(result.get('fresh_idle', {}))} | "
                     f"{rss} | {error} |")
    lines += ["", *[f"- {line}" for line in geomeans_text(results).splitlines()],
              *[f"- {line}" for line in start_up_text(results).splitlines()], ""]
    return "\n".join(lines)


def _engine_part(fresh: dict[str, Any], engine: str) -> float | None:
    """import + load + first run (ms) of one engine's fresh processes."""
    f = fresh.get(engine)
    return f["import_load_ms"] + f["first_run_ms"] if f else None


def _start_up(fresh: dict[str, Any]) -> str:
    ours, theirs = _engine_part(fresh, "cuvil"), _engine_part(fresh, "ort")
    ratio = f" ({ours / theirs:.2f})" if ours is not None and theirs else ""
    return f"{_f(ours, '.1f')} / {_f(theirs, '.1f')}{ratio}"


def start_up_text(results: list[dict[str, Any]]) -> str:
    """The largest start-up ratio cuvil / onnxruntime (import + first run) of each kind."""
    lines = []
    for key, label in (("fresh", "right after `import numpy`"), ("fresh_idle", "numpy idle")):
        ratios = {r["model"]: _engine_part(r[key], "cuvil") / _engine_part(r[key], "ort")
                  for r in results if _engine_part(r.get(key, {}), "cuvil") is not None
                  and _engine_part(r[key], "ort")}
        if ratios:
            worst = max(ratios, key=ratios.__getitem__)
            lines.append(f"start-up (import + first run) cuvil/onnxruntime, {label}: at most "
                         f"{ratios[worst]:.2f} ({worst}); over 0.2 on {sum(v > 0.2 for v in ratios.values())}"
                         f" of {len(ratios)} models")
    return "\n".join(lines)


def chart(path: Path, results: list[dict[str, Any]]) -> str | None:
    """A bar per model and batch, one colour per thread count; else why there is none."""
    try:
        import matplotlib
    except ImportError:
        return "no matplotlib (pip install -e '.[bench]')"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    labels = sorted({(r["model"], row["batch"]) for r in results for row in r["runs"] if row.get("ratio")},
                    key=lambda lb: [r["model"] for r in results].index(lb[0]) * 100 + lb[1])
    threads = sorted({row["threads"] for r in results for row in r["runs"]})
    if not labels:
        return "no ratios to draw"
    ratio = {(r["model"], row["batch"], row["threads"]): row["ratio"]
             for r in results for row in r["runs"] if row.get("ratio")}
    fig, ax = plt.subplots(figsize=(max(8, 0.45 * len(labels) * len(threads)), 5))
    width = 0.8 / len(threads)
    for i, t in enumerate(threads):
        xs = [k + (i - (len(threads) - 1) / 2) * width for k in range(len(labels))]
        heights = [ratio.get((m, b, t), 1.0) - 1.0 for m, b in labels]  # bars grow from 1
        ax.bar(xs, heights, width, bottom=1.0, label=f"{t} thread{'s' * (t > 1)}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%.2g"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%.2g"))
    ax.set_title("; ".join(f"geomean {t} thread{'s' * (t > 1)}: {g:.2f}"
                           for t, (g, _) in geomeans(results).items()))
    ax.set_xticks(range(len(labels)), [f"{m} b{b}" for m, b in labels], rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("latency cuvil / onnxruntime (< 1: cuvil faster)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def write(out: Path, info: dict[str, Any], results: list[dict[str, Any]]) -> list[Path]:
    written = [out / "results.md", out / "results.json"]
    written[0].write_text(markdown(info, results))
    ratios = {str(t): g for t, (g, _) in geomeans(results).items()}
    written[1].write_text(json.dumps({"machine": info, "models": results, "geomean_ratio": ratios},
                                     indent=1, default=str))
    missing = chart(out / "ratios.png", results)
    if missing:
        print(f"ratios.png skipped: {missing}")
    else:
        written.append(out / "ratios.png")
    return written
