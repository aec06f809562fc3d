"""The benchmark's outputs: a terminal table, a JSON file and a PNG chart."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

METHOD_LABELS = {"limit": "limit (torch copy)", "raw_nixl": "raw NIXL", "kvservice": "kvservice",
                 "sidecar": "sidecar", "raw_nixl/tcp": "raw NIXL, TCP", "kvservice/tcp": "kvservice, TCP",
                 "mooncake/tcp": "Mooncake TE, TCP"}
COLORS = {"limit": "#9e9e9e", "raw_nixl": "#1f77b4", "kvservice": "#d62728", "sidecar": "#2ca02c",
          "raw_nixl/tcp": "#aec7e8", "kvservice/tcp": "#ff9896", "mooncake/tcp": "#9467bd"}


def write_json(results: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(results, indent=1, sort_keys=False) + "\n")


def _f(value: Any, fmt: str = ".2f") -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return format(value, fmt)


#: short column names in the terminal table
SHORT = {"limit": "limit", "raw_nixl": "raw", "kvservice": "kv", "sidecar": "sc"}
#: the methods measured by ratio to raw NIXL, and where ``aggregate`` keeps that ratio
RATIOS = {"kvservice": "kv_over_raw", "sidecar": "sidecar_over_raw"}


def measured(results: dict[str, Any]) -> list[str]:
    return [m for m in results["methods"] if m not in results.get("skipped", {})]


def _cell(case: dict[str, Any], method: str, key: str, fmt: str) -> str:
    """One table cell: a number of ``method``'s, its ratio to raw NIXL, or its latency p50/p99."""
    got = case["methods"].get(method, {})
    if key == "ratio":
        return _f(case.get(RATIOS[method], {}).get("median"), fmt)
    if key == "lat":
        return _f(got.get("lat_p50_ms"), fmt) + "/" + _f(got.get("lat_p99_ms"), fmt)
    return _f(got.get(key), fmt)


def table(results: dict[str, Any]) -> str:
    meta = results["meta"]
    methods = measured(results)
    rated = [m for m in RATIOS if m in methods]  # kvservice, and the sidecar when measured
    timed = [m for m in ("raw_nixl", *rated) if m in methods]  # latency columns
    lines = [
        f"kvservice bench, {meta['date']}: {meta['cpu']}, {meta['cores']} cores, {meta['memory_gib']} GiB, "
        f"nixl {meta['versions'].get('nixl')}, torch {meta['versions'].get('torch')}; "
        f"load avg {meta['load_avg_start']:.2f} -> {meta.get('load_avg_end', 0):.2f}",
        "medians of {} repeats; ratio = median of per-repeat kvservice/raw NIXL "
        "(GB/s for w1, requests/s otherwise)".format(results["plan"]["repeats"]),
    ]
    two = meta.get("two_hosts")
    if two:
        ucx = ", ".join(f"{k}={v}" for k, v in two["ucx"].items()) or "UCX's defaults"
        lines.append(f"two hosts: sender {two['local']} (this one) -> receiver {two['peer']} (kvservice "
                     f"{two['peer_kvservice']}), rtt {two['rtt_ms']:.3f} ms, "
                     f"{'authenticated' if two['authenticated'] else 'NOT authenticated'}; {ucx}")
    if "sidecar" in methods:
        lines.append("sc: the sidecar (kvservice serve daemons, a SidecarClient worker on each side); "
                     "sc/raw its ratio, the same way")
    lines += [
        "lag: kvservice sender's event loop, p99/max, in a run of its own after the repeats (the 1 ms "
        "probe is no load on the others); floor: the same ticker in an idle process at the same time; "
        "gc: longest cyclic-GC pause in the sender",
        "",
    ]
    gb = [m for m in ("limit", "raw_nixl", *rated) if m in methods]
    rs = [m for m in ("raw_nixl", *rated) if m in methods]
    # column groups: (method, key or ratio, format), cell width, unit (rows pad it with spaces)
    groups: list[tuple[list[tuple[str, str, str]], int, str]] = [
        ([(x, "gbps", ".2f") for x in gb], 7, "GB/s"),
        ([(x, "req_s", ".0f") for x in rs], 7, "req/s"),
        ([(x, "ratio", ".2f") for x in rated], 6, ""),
        ([(x, "lat", ".1f") for x in timed], 13, "ms"),
    ]
    titles = {"ratio": "/raw", "lat": " p50/p99"}
    if not results.get("cases"):  # --only memory,kill,engine...: no table of cases
        return "\n".join(lines[:2 + bool(two)] + part_lines(results) + engine_lines(results) + target_lines(results))
    if not gb:  # only the same-transport methods (--methods): their table alone
        return "\n".join(lines[:2 + bool(two)] + tcp_lines(results) + skipped_lines(results) + part_lines(results)
                         + engine_lines(results) + target_lines(results))
    head = f"{'case':<16}{'reqs':>6}"
    for cols, width, unit in groups:
        head += " | " + " ".join(f"{SHORT[x] + titles.get(k, ''):>{width}}" for x, k, _ in cols) + (
            f" {unit}" if unit else "")
    head += f" | {'lag p99/max':>12} {'floor':>11} {'gc':>6} ms"
    lines += [head, "-" * len(head)]
    for c in results.get("cases", []):
        row = f"{c['key']:<16}{c['requests']:>6}"
        for cols, width, unit in groups:
            row += " | " + " ".join(f"{_cell(c, *col):>{width}}" for col in cols) + " " * (len(unit) + 1 if unit else 0)
        kv = c["methods"].get("kvservice", {})
        lag = _f(kv.get("lag_p99_ms"), ".1f") + "/" + _f(kv.get("lag_max_ms"), ".1f")
        floor = _f(kv.get("probe_lag_p99_ms"), ".1f") + "/" + _f(kv.get("probe_lag_max_ms"), ".1f")
        lines.append(f"{row} | {lag:>12} {floor:>11} {_f(kv.get('gc_pause_lag_max_ms'), '.1f'):>6}")
    lines += (cpu_lines(results) + tcp_lines(results) + arm_lines(results) + skipped_lines(results)
              + part_lines(results))
    return "\n".join(lines + engine_lines(results) + target_lines(results))


def _pair(got: dict[str, Any], a: str, b: str) -> str:
    return f"{_f(got.get(a), '.0f')}/{_f(got.get(b), '.0f')}"


def cpu_lines(results: dict[str, Any]) -> list[str]:
    """CPU per request of each side's processes on this host, per method: every thread, and
    for kvservice and the sidecar their event loops' threads alone (the W2 and W3 cases)."""
    methods = [m for m in ("raw_nixl", "kvservice", "sidecar") if m in measured(results)]
    looped = [m for m in ("kvservice", "sidecar") if m in methods]
    cases = [c for c in results.get("cases", []) if c["workload"] in ("w2", "w3")
             and any("cpu_send_us" in c["methods"].get(m, {}) for m in methods)]
    if not cases:
        return []
    head = (f"{'case':<16} | " + " ".join(f"{SHORT[m]:>11}" for m in methods)
            + " | " + " ".join(f"{SHORT[m] + ' loop':>11}" for m in looped))
    lines = ["", "CPU per request, us, send/recv: every thread of the side's processes (raw NIXL's sender "
             "polls without pause, so its figure is its wall time); loop: kvservice's event-loop threads "
             "alone (its Python; NIXL's calls run on other threads); the sidecar's side is its worker and "
             "its daemon", head, "-" * len(head)]
    for c in cases:
        got = c["methods"]
        cells = [_pair(got.get(m, {}), "cpu_send_us", "cpu_recv_us") for m in methods]
        loops = [_pair(got.get(m, {}), "loop_cpu_send_us", "loop_cpu_recv_us") for m in looped]
        lines.append(f"{c['key']:<16} | " + " ".join(f"{x:>11}" for x in cells)
                     + " | " + " ".join(f"{x:>11}" for x in loops))
    return lines


def part_lines(results: dict[str, Any]) -> list[str]:
    """The memory part (kvservice's state per request, the vetting child) and the SIGKILL part."""
    lines: list[str] = []
    mem = results.get("memory")
    if mem:
        lines.append("")
        lines.append(f"kvservice state per request (tracemalloc, n={mem['n']}): "
                     f"{mem['queued_per_request']:.0f} B queued, {mem['peak_per_request']:.0f} B peak in flight"
                     + (f"; {mem['gc_objects_per_request']:.1f} GC-tracked objects per queued request"
                        if "gc_objects_per_request" in mem else ""))
    if "vetting" in results:
        lines += ([""] if not mem else []) + [vetting_line(results["vetting"])]
    kill = results.get("kill")
    if kill:
        lines.append(f"SIGKILL of the receiver, {len(kill['tries'])} tries, ~{kill['inflight_per_try']:.0f} "
                     f"requests in flight each: last Failed after p50 {kill['median_ms']:.1f} ms, "
                     f"p99 {kill['p99_ms']:.1f} ms, max {kill['max_ms']:.1f} ms; none left pending: "
                     f"{_f(kill['all_failed'])}")
    return lines


def vetting_line(vet: dict[str, Any]) -> str:
    """The vetting child's cost (``kvservice.bench.vetting``), or why it could not be measured."""
    if "error" in vet:
        return f"metadata-vetting child (one per service): NOT MEASURED: {vet['error']}"
    pss = f", PSS {vet['pss_mib']:.0f} MiB" if vet.get("pss_mib") is not None else ""
    return (f"metadata-vetting child (one per service), median of {vet['children']} started as a service "
            f"starts it: ready after {vet['ready_s']:.2f} s, {vet['cpu_s']:.2f} s CPU, "
            f"RSS {vet['rss_mib']:.0f} MiB{pss} (load avg {vet['load_avg']:.1f})")


def skipped_lines(results: dict[str, Any]) -> list[str]:
    return [f"{name}: skipped ({why})" for name, why in results.get("skipped", {}).items()]


#: the same-transport comparison's methods (``kvservice bench`` without ``--no-tcp``) and short names
TCP_SHORT = {"raw_nixl/tcp": "raw", "kvservice/tcp": "kv", "mooncake/tcp": "mc"}
TCP_RATIOS = {"kv/raw": "kv_over_raw_tcp", "kv/mc": "kv_over_mooncake"}


def tcp_lines(results: dict[str, Any]) -> list[str]:
    """Raw NIXL and kvservice with UCX_TLS=tcp beside Mooncake over TCP: one table, per case
    the case's own metric (GB/s for w1, requests/s otherwise), the ratios and latencies."""
    methods = [m for m in TCP_SHORT if m in measured(results)]
    if not methods or not results.get("cases"):
        return []
    head = (f"{'case':<16}{'reqs':>6} | " + " ".join(f"{TCP_SHORT[m]:>8}" for m in methods) + " GB/s|req/s | "
            + " ".join(f"{r:>6}" for r in TCP_RATIOS) + " | "
            + " ".join(f"{TCP_SHORT[m] + ' p50/p99':>13}" for m in methods) + " ms")
    lines = ["", "over TCP on both sides: NIXL with UCX_TLS=tcp (raw, kv), Mooncake's Transfer Engine over TCP "
             "(mc; a request arrives when the sender's batch completes); GB/s for w1, requests/s otherwise", head,
             "-" * len(head)]
    for c in results["cases"]:
        key = "gbps" if c["workload"] == "w1" else "req_s"
        fmt = ".2f" if key == "gbps" else ".0f"
        row = f"{c['key']:<16}{c['requests']:>6} | " + " ".join(
            f"{_f(c['methods'].get(m, {}).get(key), fmt):>8}" for m in methods) + " " * 11 + " | "
        row += " ".join(f"{_f(c.get(r, {}).get('median')):>6}" for r in TCP_RATIOS.values()) + " | "
        row += " ".join(f"{_cell(c, m, 'lat', '.1f'):>13}" for m in methods)
        lines.append(row)
    return lines


#: an arm measured beside kvservice from the same run: (its method, its ratio's key, what it is)
ARMS = (
    ("kvservice/verify", "verify_over_kv", "landing checks (verify_landing = true on both sides: the sender's "
     "CRC32C of each chunk, the receiver's of its pages before SUCCESS)"),
    ("kvservice/identity", "identity_over_kv", "member identities (each side its own certificate from one "
     "authority, proven in the link's handshake; requests bound to the proven member)"),
)


def arm_lines(results: dict[str, Any]) -> list[str]:
    """``--verify-landing``, ``--identity``: kvservice so configured beside kvservice as it is,
    per case the case's own metric, their ratio (median of per-repeat ratios) and latencies."""
    lines: list[str] = []
    for arm, ratio, what in ARMS:
        methods = ["kvservice", arm]
        if not set(methods) <= set(measured(results)) or not results.get("cases"):
            continue
        short = arm.split("/")[1]
        head = (f"{'case':<16}{'reqs':>6} | {'kv':>8} {short:>8} GB/s|req/s | {'ratio':>6} | "
                f"{'kv p50/p99':>13} {short + ' p50/p99':>15} ms | {'kv lag':>10} {short + ' lag':>10} ms")
        lines += ["", f"{what}; ratio = {short}/kv, per repeat, median; lag: the sender's event loop, p99/max",
                  head, "-" * len(head)]
        for c in results["cases"]:
            key = "gbps" if c["workload"] == "w1" else "req_s"
            fmt = ".2f" if key == "gbps" else ".0f"
            row = f"{c['key']:<16}{c['requests']:>6} | " + " ".join(
                f"{_f(c['methods'].get(m, {}).get(key), fmt):>8}" for m in methods) + " " * 11 + " | "
            row += f"{_f(c.get(ratio, {}).get('median')):>6} | "
            row += f"{_cell(c, 'kvservice', 'lat', '.1f'):>13} {_cell(c, arm, 'lat', '.1f'):>15} | "
            lags = [c["methods"].get(m, {}) for m in methods]
            row += " ".join(f"{_f(g.get('lag_p99_ms'), '.1f') + '/' + _f(g.get('lag_max_ms'), '.1f'):>10}"
                            for g in lags)
            lines.append(row)
    return lines


def target_lines(results: dict[str, Any]) -> list[str]:
    if not results.get("targets"):
        return []
    lines = ["", f"{'target':<52} {'goal':>12} {'measured':>10}  met"]
    for t in results["targets"]:
        note = f"  ({t['note']})" if t.get("note") else ""
        value = t["measured"]
        shown = _f(value, ".3f" if isinstance(value, float) and abs(value) < 10 else ".1f")
        lines.append(f"{t['target']:<52} {t['goal']:>12} {shown:>10}  {_f(t['met'])}{note}")
    return lines


def engine_lines(results: dict[str, Any]) -> list[str]:
    """The engine-memory cases (``kvservice.bench.engines``): their own table."""
    eng = results.get("engines")
    if not eng or not eng.get("cases"):
        return []
    m = eng["model"]
    lines = ["", f"engine memory ({m['layers']} layers x K/V regions, {m['heads']} KV heads x {m['head_dim']}, "
             f"{m['page_tokens']}-token pages; medians of {eng['plan']['repeats']} repeats; each method's "
             "processes hold the same tensors and post the same descriptors)"]
    rated = [c for c in eng["cases"] if "kv_over_raw" in c]
    if rated:
        head = (f"{'case':<18}{'MiB':>6}{'descs':>8} | {'raw':>7} {'kv':>7} GB/s | {'kv/raw':>6} | "
                f"{'nhd/hnd raw':>11} {'kv':>5} | {'fair raw':>8} {'kv':>5} {'min/max raw':>11} {'kv':>5}")
        lines += [head, "-" * len(head)]
        for c in rated:
            cost = c.get("nhd_over_hnd", {})
            raw, kv = c["methods"]["raw_nixl"], c["methods"]["kvservice"]
            lines.append(
                f"{c['key']:<18}{c['bytes'] / 2**20:>6.0f}{_f(c.get('descriptors'), 'd'):>8} | "
                f"{_f(raw['gbps']):>7} {_f(kv['gbps']):>7}      | {_f(c['kv_over_raw']['median']):>6} | "
                f"{_f(cost.get('raw_nixl')):>11} {_f(cost.get('kvservice')):>5} | "
                f"{_f(raw.get('jain'), '.3f'):>8} {_f(kv.get('jain'), '.3f'):>5} "
                f"{_f(raw.get('min_over_max')):>11} {_f(kv.get('min_over_max')):>5}")
        lines.append("descs: index entries posted per run (before NIXL merges adjacent ones); nhd/hnd: GB/s of "
                     "token-major (sliced: raw posts a run per token, kvservice goes through staging) over "
                     "head-major pages at the same TP pair; "
                     "fair: Jain's index of per-peer GB/s")
    for c in eng["cases"]:
        if c["part"] == "layerwise":
            lay, whole = c["modes"]["layer"], c["modes"]["whole"]
            lines.append(
                f"layerwise: {c['pages']} pages ({c['bytes'] / 2**20:.0f} MiB), forward pass {c['layers']} x "
                f"{c['per_layer_ms']:g} ms, {c['requests']} requests per mode; last layer computed -> decode "
                f"SUCCESS p50/p99: layer-wise {lay['tail_p50_ms']:.2f}/{lay['tail_p99_ms']:.2f} ms, whole request "
                f"{whole['tail_p50_ms']:.2f}/{whole['tail_p99_ms']:.2f} ms (layer/whole "
                f"{_f(c['layer_over_whole'].get('p50'))}/{_f(c['layer_over_whole'].get('p99'))})")
    return lines


def chart(results: dict[str, Any], path: Path) -> Path | None:
    """Throughput per workload and method; w3 throughput and latency vs concurrency.

    Returns ``None`` (and writes nothing) when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    cases = results.get("cases", [])
    methods = measured(results)
    eng = [c for c in results.get("engines", {}).get("cases", []) if "kv_over_raw" in c]
    lw = [c for c in results.get("engines", {}).get("cases", []) if c["part"] == "layerwise"]
    rows = (2 if cases else 0) + (1 if eng or lw else 0)
    if not rows:
        return None
    fig, grid = plt.subplots(rows, 2, figsize=(13, 4.5 * rows), squeeze=False)
    axes = grid if cases else [[None, None], [None, None], grid[0]]
    meta = results["meta"]
    what = "kvservice in process and as a sidecar" if "sidecar" in methods else "kvservice"
    two = meta.get("two_hosts")
    where = f"from {two['local']} to {two['peer']}" if two else "on 127.0.0.1"
    vs = "raw NIXL" if "limit" not in methods else "raw NIXL vs memory copy"
    fig.suptitle(f"{what} vs {vs}: Llama-3-8B KV pages, {where}\n"
                 f"{meta['date']}, {meta['cpu']}, {meta['cores']} cores, nixl {meta['versions'].get('nixl')}",
                 fontsize=10)
    if eng or lw:
        _engine_chart(axes[2] if cases else grid[0], eng, lw)
    if not cases:
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path
    for ax, wl, metric, ylabel in ((axes[0][0], "w1", "gbps", "GB/s (one 2048-token request)"),
                                   (axes[0][1], "w2", "req_s", "requests/s (1-4 pages each)")):
        sel = [c for c in cases if c["workload"] == wl]
        width = 0.8 / max(1, len(methods))
        for i, m in enumerate(methods):
            xs = [j + i * width for j in range(len(sel))]
            ys = [c["methods"].get(m, {}).get(metric, 0) for c in sel]
            ax.bar(xs, ys, width, label=METHOD_LABELS.get(m, m), color=COLORS.get(m))
        ax.set_xticks([j + width * (len(methods) - 1) / 2 for j in range(len(sel))])
        ax.set_xticklabels([c["variant"] for c in sel])
        ax.set_ylabel(ylabel)
        ax.set_title(f"workload {wl[1]}")
        ax.legend(fontsize=8)
    sel = [c for c in cases if c["workload"] == "w3"]
    conc = [c["concurrency"] for c in sel]
    ax = axes[1][0]
    for m in methods:
        ax.plot(conc, [c["methods"].get(m, {}).get("req_s", 0) for c in sel], "o-", label=METHOD_LABELS.get(m, m),
                color=COLORS.get(m))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("requests in flight")
    ax.set_ylabel("requests/s (one page each)")
    ax.set_title("workload 3: throughput vs concurrency")
    ax.legend(fontsize=8)
    ax = axes[1][1]
    for m in methods:
        if m == "limit":
            continue
        for q, style in (("lat_p50_ms", "o-"), ("lat_p99_ms", "x--")):
            ax.plot(conc, [c["methods"].get(m, {}).get(q, 0) for c in sel], style, color=COLORS.get(m),
                    label=f"{METHOD_LABELS.get(m, m)} {q[4:7]}")
    lag = [c["methods"].get("kvservice", {}).get("lag_p99_ms") for c in sel]
    if any(v is not None for v in lag):
        ax.plot(conc, [v or 0 for v in lag], "s:", color="black", label="kvservice sender loop lag p99")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("requests in flight")
    ax.set_ylabel("ms")
    ax.set_title("workload 3: latency vs concurrency")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def markdown(results: dict[str, Any], chart_name: str | None) -> str:
    """The run as a Markdown page: machine, the terminal table, targets, chart."""
    meta = results["meta"]
    lines = [
        f"# kvservice bench: {meta['date']}",
        "",
        f"Machine: {meta['cpu']}, {meta['cores']} cores, {meta['memory_gib']} GiB, {meta['os']}; "
        f"Python {meta['python']}, " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()) + ".",
        f"Load average {meta['load_avg_start']:.2f} at the start, {meta.get('load_avg_end', 0):.2f} at the end; "
        f"wall time {meta.get('wall_s', '?')} s.",
        "",
        "Generated by `kvservice bench` (see `docs/perf/README.md` for what each column means).",
        "",
        "```",
        table(results),
        "```",
    ]
    if chart_name:
        lines += ["", f"![throughput and latency]({chart_name})"]
    return "\n".join(lines) + "\n"


def _engine_chart(row: Any, eng: list[dict[str, Any]], lw: list[dict[str, Any]]) -> None:
    """Engine-memory cases: GB/s of raw NIXL and kvservice per case; layer-wise tails."""
    ax = row[0]
    width = 0.4
    for i, m in enumerate(("raw_nixl", "kvservice")):
        ax.bar([j + i * width for j in range(len(eng))], [c["methods"][m]["gbps"] for c in eng], width,
               label=METHOD_LABELS[m], color=COLORS[m])
    ax.set_xticks([j + width / 2 for j in range(len(eng))])
    ax.set_xticklabels([c["key"] for c in eng], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("GB/s")
    ax.set_title("engine memory: engine layouts, tensor parallelism, fan-out")
    ax.legend(fontsize=8)
    ax = row[1]
    for c in lw:
        for mode, color in (("layer", COLORS["kvservice"]), ("whole", COLORS["raw_nixl"])):
            tails = sorted(c["tails_ms"][mode])
            ax.plot(tails, [(k + 1) / len(tails) for k in range(len(tails))], "o-", color=color,
                    label=f"{'layer-wise' if mode == 'layer' else 'whole request'} sends")
        ax.set_title(f"last layer computed -> decode SUCCESS ({c['layers']} layers x {c['per_layer_ms']:g} ms, "
                     f"{c['bytes'] / 2**20:.0f} MiB)", fontsize=9)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of requests")
    ax.legend(fontsize=8)
