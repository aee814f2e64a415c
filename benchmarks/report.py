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
            f"onnxruntime {info['onnxruntime']}, openvino {info.get('openvino') or 'absent'}, "
            f"cuvil {info['cuvil']}, python {info['python']}; "
            f"torch {'present' if info['torch'] else 'absent: fallback models'}; load average {load}; "
            f"2 threads get {info['fma_scaling_start']:.2f} cores' worth of FMAs (peak.fma_scaling)")


def _gflops(stats: dict[str, Any] | None) -> str:
    if not stats:
        return "—"
    fraction = stats.get("peak_fraction")
    return f"{stats['gflops']:.1f}" + (f" ({100 * fraction:.0f}%)" if fraction is not None else "")


def _ms(stats: dict[str, Any] | None) -> str:
    return f"{stats['median_ms']:9.3f} ms" if stats else "        — ms"


def run_line(model: str, row: dict[str, Any]) -> str:
    c, o, v = row.get("cuvil"), row["ort"], row.get("openvino")
    return (f"  {model:<22} t{row['threads']} b{row['batch']:<2} cuvil {_ms(c)}  onnxruntime {_ms(o)}  "
            f"openvino {_ms(v)}  cuvil/ort {_f(row.get('ratio'))}  cuvil/best {_f(row.get('ratio_best'))}  "
            f"GFLOP/s {_gflops(c)} vs {_gflops(o)} / {_gflops(v)}")


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
    if "skipped" in result:
        parts.append(f"skipped: {result['skipped']}")
    if "error" in result:
        parts.append(f"ERROR {result['error']}")
    if "openvino_error" in result:
        parts.append(f" OPENVINO {result['openvino_error']}")
    if "fma_scaling" in result:
        parts.append(f" (then 2 threads got {result['fma_scaling']:.2f} cores' worth of FMAs)")
    return "".join(parts)


#: rows whose cuvil / best ratio is above this are listed at the end
SLOW = 1.10
_NAMES = {"ort": "onnxruntime", "openvino": "openvino"}


def geomeans(results: list[dict[str, Any]], key: str = "ratio") -> dict[int, tuple[float, int]]:
    """Geometric mean of a ratio per thread count, over every model and batch: `ratio` is
    cuvil / onnxruntime, `ratio_best` cuvil / the faster of onnxruntime and OpenVINO."""
    by_threads: dict[int, list[float]] = {}
    for result in results:
        for row in result["runs"]:
            if row.get(key):
                by_threads.setdefault(row["threads"], []).append(row[key])
    return {t: (math.exp(sum(map(math.log, r)) / len(r)), len(r)) for t, r in sorted(by_threads.items())}


def geomeans_text(results: list[dict[str, Any]]) -> str:
    lines = []
    for key, label in (("ratio", "cuvil/onnxruntime"), ("ratio_best", "cuvil/best(onnxruntime, openvino)")):
        lines += [f"geomean ratio {label} at {t} thread{'s' if t > 1 else ''}: {g:.2f} "
                  f"(over {n} model x batch runs)" for t, (g, n) in geomeans(results, key).items()]
    slow = [f"{r['model']} t{row['threads']} b{row['batch']} {row['ratio_best']:.2f} "
            f"(vs {_NAMES[row['best']]})"
            for r in results for row in r["runs"] if (row.get("ratio_best") or 0) > SLOW]
    lines.append(f"cuvil/best above {SLOW:.2f}: " + ("; ".join(slow) if slow else "none"))
    return "\n".join(lines)


def markdown(info: dict[str, Any], results: list[dict[str, Any]]) -> str:
    lines = ["# cuvil vs onnxruntime and OpenVINO", "", header(info).replace("\n", "  \n"),
             f"load average at the end {', '.join(f'{x:.2f}' for x in info['load_average_end'])}; "
             f"2 threads get {info['fma_scaling_end']:.2f} cores' worth of FMAs"
             + ("; --quick run (short budgets)" if info["quick"] else ""), "",
             ("Latency: median (IQR) of interleaved calls in one process, same inputs. Ratios < 1: cuvil "
              "is faster; *cuvil/best*: against the faster of onnxruntime and OpenVINO. GFLOP/s in "
              "brackets: share of the fp32 peak of that many cores (best ISA). Max rel diff: largest "
              "difference from onnxruntime's outputs, relative to its largest output."), "",
             ("| model | threads | batch | GFLOP | cuvil ms | onnxruntime ms | openvino ms | cuvil/ort | "
              "cuvil/openvino | cuvil/best | cuvil GFLOP/s | onnxruntime GFLOP/s | openvino GFLOP/s | "
              "max rel diff cuvil | max rel diff openvino |"),
             "| --- |" + " ---: |" * 14]
    for result in results:
        for row in result["runs"]:
            c, o, v = row.get("cuvil"), row["ort"], row.get("openvino")
            gflop = f"{row['gflop']:.3g}" + ("" if row["gflop_complete"] else "+")
            lines.append(
                f"| {result['model']} | {row['threads']} | {row['batch']} | {gflop} | {_ms_iqr(c)} | "
                f"{_ms_iqr(o)} | {_ms_iqr(v)} | {_f(row.get('ratio'))} | {_f(row.get('ratio_openvino'))} | "
                f"{_f(row.get('ratio_best'))} | {_gflops(c)} | {_gflops(o)} | {_gflops(v)} | "
                f"{_f(row.get('max_rel_diff'), '.1e')} | {_f(row.get('openvino_max_rel_diff'), '.1e')} |")
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
        notes = [result.get("error", ""), f"skipped: {result['skipped']}" if "skipped" in result else "",
                 f"openvino: {result['openvino_error']}" if "openvino_error" in result else ""]
        error = " ".join(" ".join(notes).split()).replace("|", "\\|")
        lines.append(f"| {result['model']} | {result.get('source', '—')} | "
                     f"{_f(result.get('build_s'), '.1f')} | {_f(result.get('wheel_kb'), '.0f')} | "
                     f"{_f(result.get('library_kb'), '.0f')} | {first} | "
                     f"{_start_up(fresh)} | {_start_up(result.get('fresh_idle', {}))} | "
                     f"{rss} | {error} |")
    lines += ["", *[f"- {line}" for line in geomeans_text(results).splitlines()],
              *[f"- {line}" for line in start_up_text(results).splitlines()], ""]
    return "\n".join(lines)


def _ms_iqr(stats: dict[str, Any] | None) -> str:
    return f"{stats['median_ms']:.3f} ({stats['iqr_ms']:.3f})" if stats else "—"


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
    best = {str(t): g for t, (g, _) in geomeans(results, "ratio_best").items()}
    written[1].write_text(json.dumps({"machine": info, "models": results, "geomean_ratio": ratios,
                                      "geomean_ratio_best": best}, indent=1, default=str))
    missing = chart(out / "ratios.png", results)
    if missing:
        print(f"ratios.png skipped: {missing}")
    else:
        written.append(out / "ratios.png")
    return written
