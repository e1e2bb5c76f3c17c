"""Prometheus metrics: off unless `ckptfs mount --metrics-port PORT`; bound to 127.0.0.1 by default.

A custom collector reads the store's counters at scrape time, so the write
and drain paths pay nothing for metrics. The HTTP server runs in
prometheus_client's own thread; the store lives in the trio thread, so each
scrape asks the trio loop for one consistent reading (`read_metrics`, run
through `trio.from_thread.run_sync`) and converts it to metric families here.

Metrics (all prefixed ``ckptfs_``):

    bytes_absorbed_total        bytes written into the mount (absorbed in memory)
    bytes_drained_total         file bytes written to the devices
    bytes_skipped_total         bytes never drained because they went stale first
                                (deleted, truncated or overwritten)
    drain_latency_seconds       histogram: a close or fsync until its data is durable
    memory_bytes{kind}          the arena: capacity, undrained, cached, lent, free
    backpressure_waits_total    writes that found the memory budget full and waited
    backpressure_wait_seconds_total   time they spent waiting
    device_written_bytes_total{device}, device_read_bytes_total{device}
    device_write_bytes_per_second{device}, device_read_bytes_per_second{device}
                                bandwidth over the last interval
    device_errors_total{device} failed I/Os (writes, reads, flushes)
    device_capacity_bytes{device}, device_used_bytes{device}
    files{state}                files by state: memory, draining, failed, durable
    records_pending             journal records waiting to be committed
    records_voided_total        commits dropped because they were superseded
    dedupe_bytes_total          bytes not written: the devices held them already (--dedupe on)
    shared_bytes                durable bytes naming an extent another chunk names (saved space)
    eta_seconds                 estimated time until everything is durable (NaN: unknown)
    durability_lag_seconds      how long the oldest record not yet in the journal has waited
                                (stays under max_lag + drain time while the devices keep up)
    max_lag_seconds             the mount's --max-lag
    unclean_recoveries_total    1 when this mount recovered from an unclean shutdown, else 0
    journal_frames_discarded_total   torn or damaged journal frames dropped by that recovery
    restore_files{kind}         while restoring from an object store: total, restored
    restore_bytes{kind}         total, restored (in the filesystem, checked), fetched (GET bytes)
    restore_errors_total        failed fetches (checksum mismatches, S3 errors), retried
    restore_generation          the manifest generation being restored
    restore_done                1 once everything restored is local and durable

With --replicate (replicate/replicator.py):

    replication_lag_seconds     how long the oldest durable change not yet in a standing
                                manifest of the object store has waited
    replication_bytes_uploaded_total, replication_objects_uploaded_total (segments)
    replication_bytes_shared_total    bytes of new file versions the store held already
    replication_manifest_generation   the newest manifest's generation
    replication_errors_total{cause}   failed object-store calls (auth, no-bucket, network,
                                throttled, server, other, device, uploader), each retried
                                with backoff
    replication_failing         1 while the last call failed (retrying), else 0
    replication_failing_since_seconds   when that failure began (0: none)
    replication_waiting_bytes   bytes of the newest durable state not in the store yet
"""
from __future__ import annotations

import logging
import math

from .control import plain

log = logging.getLogger("ckptfs.metrics")


def read_metrics(store, monitor, window: float = 2.0, sections: dict | None = None, replicator=None) -> dict:
    """One consistent reading of everything exported (call in the trio thread): `Store.statistics()`
    plus the monitor's rates, plus the `sections` of the status (name -> callable) it exports
    (restore), and the replicator's statistics with --replicate."""
    st = store.statistics()
    rates = monitor.rates(window)
    by_state = {"memory": 0, "draining": 0, "failed": 0}
    regular_not_durable = 0
    ns = store.ns
    for ino, f in st.files.items():
        by_state[f.state] += 1
        inode = ns.inodes.get(ino) if ns is not None else None
        if inode is not None and inode.is_reg:
            regular_not_durable += 1
    regular = sum(1 for i in ns.inodes.values() if i.is_reg and i.nlink > 0) if ns is not None else 0
    by_state["durable"] = max(0, regular - regular_not_durable)
    to_drain = sum(f.bytes - f.drained for f in st.files.values())
    devices = [{"device": d.path, "index": str(d.index), "written": d.bytes_written, "read": d.bytes_read,
                "errors": d.errors, "write_bps": rates.write_bps[d.index], "read_bps": rates.read_bps[d.index],
                "capacity": d.capacity, "used": d.used} for d in st.devices]
    lat = monitor.latency
    return {
        "absorbed": st.bytes_absorbed, "drained": st.bytes_drained, "skipped": st.bytes_skipped,
        "latency": {"buckets": lat.cumulative(), "sum": lat.sum, "count": lat.count},
        "memory": {"capacity": st.arena, **st.arena_parts()},
        "backpressure_waits": monitor.backpressure_waits, "backpressure_seconds": monitor.backpressure_seconds,
        "devices": devices, "files": by_state,
        "records_pending": st.records_pending, "records_voided": st.records_voided,
        "lag": st.lag, "max_lag": st.max_lag,
        "unclean": 0 if st.recovery.get("clean", True) else 1,
        "discarded": len(st.recovery.get("discarded", ())),
        "eta": 0.0 if to_drain == 0 else (to_drain / rates.drain_bps if rates.drain_bps > 0 else math.nan),
        "restore": plain(sections["restore"]()) if sections and "restore" in sections else None,
        "replication": plain(replicator.statistics()) if replicator is not None else None,
        "shared_bytes": store.durable.shared_bytes,
        "dedupe_bytes": store.dedupe.bytes_shared if store.dedupe is not None else 0,
    }


def _restore_families(r: dict) -> list:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    files = GaugeMetricFamily("ckptfs_restore_files", "Files of the restore from an object store.", labels=["kind"])
    files.add_metric(["total"], r["files_total"])
    files.add_metric(["restored"], r["files_restored"])
    size = GaugeMetricFamily("ckptfs_restore_bytes", "Bytes of the restore: total, restored (checked, in the "
                             "filesystem), fetched (GET bytes, retries included).", labels=["kind"])
    for kind in ("total", "restored", "fetched"):
        size.add_metric([kind], r[f"bytes_{kind}"])
    return [files, size,
            CounterMetricFamily("ckptfs_restore_errors", "Failed restore fetches (retried).", value=r["errors_total"]),
            GaugeMetricFamily("ckptfs_restore_generation", "The manifest generation being restored.",
                              value=r["generation"]),
            GaugeMetricFamily("ckptfs_restore_done", "1 once everything restored is local and durable.",
                              value=1 if r["state"] == "done" else 0)]


class StoreCollector:
    """A prometheus_client collector; `read()` returns `read_metrics(...)` or None (daemon not serving)."""

    def __init__(self, read):
        self.read = read

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        try:
            m = self.read()
        except Exception:  # noqa: BLE001 - e.g. the trio loop has ended: export nothing
            log.debug("metrics reading failed", exc_info=True)
            m = None
        if m is None:
            return []

        def counter(name, doc, value):
            return CounterMetricFamily(f"ckptfs_{name}", doc, value=value)

        out = [
            counter("bytes_absorbed", "Bytes written into the mount (absorbed in memory).", m["absorbed"]),
            counter("bytes_drained", "File bytes written to the devices.", m["drained"]),
            counter("bytes_skipped", "Bytes never drained because they went stale first "
                    "(deleted, truncated or overwritten).", m["skipped"]),
            counter("backpressure_waits", "Writes that found the memory budget full and waited for the drain.",
                    m["backpressure_waits"]),
            counter("backpressure_wait_seconds", "Seconds writes spent waiting for memory.",
                    m["backpressure_seconds"]),
            counter("records_voided", "Journal commits dropped because they were superseded.",
                    m["records_voided"]),
            counter("dedupe_bytes", "Bytes not written because the devices held them already (--dedupe on).",
                    m["dedupe_bytes"]),
            GaugeMetricFamily("ckptfs_shared_bytes", "Durable bytes that name an extent another chunk names: "
                              "what the devices would hold more without dedupe.", value=m["shared_bytes"]),
            GaugeMetricFamily("ckptfs_records_pending", "Journal records waiting to be committed.",
                              value=m["records_pending"]),
            GaugeMetricFamily("ckptfs_durability_lag_seconds",
                              "Seconds the oldest record not yet in the journal has waited.", value=m["lag"]),
            GaugeMetricFamily("ckptfs_max_lag_seconds", "The mount's --max-lag.", value=m["max_lag"]),
            counter("unclean_recoveries", "Recoveries from an unclean shutdown at this mount (0 or 1).",
                    m["unclean"]),
            counter("journal_frames_discarded", "Torn or damaged journal frames dropped at recovery.",
                    m["discarded"]),
            GaugeMetricFamily("ckptfs_eta_seconds", "Estimated seconds until everything is durable (NaN: unknown).",
                              value=m["eta"]),
        ]
        lat = m["latency"]
        buckets = [("+Inf" if math.isinf(ub) else repr(ub), n) for ub, n in lat["buckets"]]
        out.append(HistogramMetricFamily("ckptfs_drain_latency_seconds",
                                         "Seconds from a close or fsync until its data is durable.",
                                         buckets=buckets, sum_value=lat["sum"]))
        mem = GaugeMetricFamily("ckptfs_memory_bytes", "The memory arena: capacity, undrained, cached, lent (receive "
                                "buffers of the FUSE workers), free.",
                                labels=["kind"])
        for kind, v in m["memory"].items():
            mem.add_metric([kind], v)
        out.append(mem)
        files = GaugeMetricFamily("ckptfs_files", "Files by state.", labels=["state"])
        for state, v in m["files"].items():
            files.add_metric([state], v)
        out.append(files)
        per_device = [
            (CounterMetricFamily, "device_written_bytes", "Bytes written to the device.", "written"),
            (CounterMetricFamily, "device_read_bytes", "Bytes read from the device.", "read"),
            (CounterMetricFamily, "device_errors", "Failed I/Os on the device.", "errors"),
            (GaugeMetricFamily, "device_write_bytes_per_second", "Write bandwidth over the last interval.",
             "write_bps"),
            (GaugeMetricFamily, "device_read_bytes_per_second", "Read bandwidth over the last interval.",
             "read_bps"),
            (GaugeMetricFamily, "device_capacity_bytes", "Data capacity of the device.", "capacity"),
            (GaugeMetricFamily, "device_used_bytes", "Data space in use on the device.", "used"),
        ]
        for cls, name, doc, key in per_device:
            fam = cls(f"ckptfs_{name}", doc, labels=["device", "index"])
            for dev in m["devices"]:
                fam.add_metric([dev["device"], dev["index"]], dev[key])
            out.append(fam)
        if m.get("restore"):
            out.extend(_restore_families(m["restore"]))
        if m.get("replication") is not None:
            out.extend(_replication_families(m["replication"]))
        return out


def _replication_families(rep: dict) -> list:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    from ..replicate.client import CAUSES

    errors = CounterMetricFamily("ckptfs_replication_errors", "Failed object-store calls (retried with backoff).",
                                 labels=["cause"])
    for cause in CAUSES:
        errors.add_metric([cause], rep["errors"].get(cause, 0))
    return [
        GaugeMetricFamily("ckptfs_replication_lag_seconds", "Seconds the oldest durable change not yet in a "
                          "standing manifest of the object store has waited.", value=rep["lag"]),
        CounterMetricFamily("ckptfs_replication_bytes_uploaded", "File bytes uploaded to the object store.",
                            value=rep["bytes_uploaded"]),
        CounterMetricFamily("ckptfs_replication_objects_uploaded", "Segments uploaded to the object store.",
                            value=rep["objects_uploaded"]),
        CounterMetricFamily("ckptfs_replication_bytes_shared", "Bytes of new file versions not uploaded: the "
                            "object store held their segments already.", value=rep["bytes_shared"]),
        GaugeMetricFamily("ckptfs_replication_manifest_generation", "The newest manifest's generation.",
                          value=rep["generation"]),
        GaugeMetricFamily("ckptfs_replication_failing", "1 while object-store calls fail (retrying), else 0.",
                          value=0 if rep["failing"] is None else 1),
        GaugeMetricFamily("ckptfs_replication_failing_since_seconds", "Wall-clock time the current failure "
                          "began (0: none).", value=(rep["failing"] or {}).get("since") or 0),
        GaugeMetricFamily("ckptfs_replication_waiting_bytes", "Bytes of the newest durable state not in the "
                          "object store yet.", value=rep["waiting_bytes"]),
        errors,
    ]


class MetricsServer:
    """prometheus_client's HTTP server in its own thread, bound to `addr:port` (port 0: any free port)."""

    def __init__(self, addr: str, port: int):
        from prometheus_client import CollectorRegistry
        from prometheus_client.process_collector import ProcessCollector

        self.addr, self.port = addr, port
        self.registry = CollectorRegistry(auto_describe=False)
        ProcessCollector(registry=self.registry)  # RSS, CPU time, open fds of the daemon
        self.read = None
        self.registry.register(StoreCollector(lambda: self.read() if self.read is not None else None))
        self._server = None

    def start(self) -> None:
        from prometheus_client import start_http_server

        self._server, _thread = start_http_server(self.port, addr=self.addr, registry=self.registry)
        self.port = self._server.server_port

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
