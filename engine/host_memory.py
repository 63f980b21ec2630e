"""How full the memory this process may use is: the host's, or its cgroup's limit.

On a CPU host the KV pool, the weights and everything else the daemon holds live in host
memory; the kernel's OOM killer (or systemd's `MemoryMax=` on the unit's cgroup) ends the
whole daemon when it runs out, every request with it. The rule ladder reads this signal to give
KV memory back before that (`shrink_kv_pool`).

The ratio is the higher of
- the host's: 1 - MemAvailable / MemTotal (/proc/meminfo; MemAvailable counts page cache the
  kernel can drop, so a warm file cache is not pressure), and
- the memory cgroup's, where it has a limit (cgroup v2 `memory.max`, v1
  `memory.limit_in_bytes`): its working set (usage less the inactive file pages of
  memory.stat, the reading container runtimes evict on) / the limit.
None when neither can be read (not Linux): an unknown signal never acts.

`room_bytes` is what the process may still take before either reading passes a share: a KV
pool grows back (restore_kv_pool, a larger kv_cache_bytes) only into that room, so giving the
memory back and taking it again cannot chase each other.
"""

from __future__ import annotations

from pathlib import Path

NO_LIMIT = 1 << 60  # a cgroup v1 limit at or above this is "unlimited" rounded to pages


Usage = tuple[int, int]  # (bytes in use, bytes that may be used)


def host_memory_used_ratio(
    proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")
) -> float | None:
    ratios = [min(1.0, max(0.0, used / limit)) for used, limit in _usages(proc, cgroup_root)]
    return max(ratios) if ratios else None


def room_bytes(
    below: float, proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")
) -> int | None:
    """Bytes the process may still take while both readings stay at or under `below` of their
    limits (0 when past it already); None when neither can be read."""
    rooms = [max(0, int(limit * below) - used) for used, limit in _usages(proc, cgroup_root)]
    return min(rooms) if rooms else None


def _usages(proc: Path, root: Path) -> list[Usage]:
    return [u for u in (_host(proc), _cgroup(proc, root)) if u is not None]


def _host(proc: Path) -> Usage | None:
    try:
        text = (proc / "meminfo").read_text()
    except OSError:
        return None
    fields = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            fields[name] = int(parts[0]) * 1024  # kB
    total, available = fields.get("MemTotal"), fields.get("MemAvailable")
    if not total or available is None:
        return None
    return total - available, total


def _cgroup(proc: Path, root: Path) -> Usage | None:
    """The working set of this process's memory cgroup and its limit; None without one."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one unified hierarchy
            files = ("memory.max", "memory.current", "inactive_file")
            found = _read(root / path.lstrip("/"), *files)
        elif "memory" in controllers.split(","):  # v1: the memory controller's own tree
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
            found = _read(root / "memory" / path.lstrip("/"), *files)
        else:
            continue
        if found is not None:
            return found
    return None


def _read(group: Path, limit_file: str, usage_file: str, inactive_key: str) -> Usage | None:
    try:
        limit = group.joinpath(limit_file).read_text().strip()
        usage = int(group.joinpath(usage_file).read_text())
        stat = group.joinpath("memory.stat").read_text()
    except (OSError, ValueError):
        return None
    # "max" (v2) or the page-rounded 2^63 (v1): no limit of its own
    if not limit.isdigit() or not 0 < int(limit) < NO_LIMIT:
        return None
    inactive = 0
    for line in stat.splitlines():
        name, _, value = line.partition(" ")
        if name == inactive_key and value.strip().isdigit():
            inactive = int(value)
    return max(0, usage - inactive), int(limit)
