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
  memory.stat, the reading container runtimes evict on) / the limit. Every ancestor with a
  limit counts too (a slice's `MemoryMax=`, a pod's limit above its container), each with its
  own usage, and the group is found through /proc/self/mountinfo's mount root, so a container
  that sees the host's cgroup paths reads the group mounted for it.
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
    host = _host(proc)
    return ([host] if host is not None else []) + _cgroups(proc, root)


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


_V2 = ("memory.max", "memory.current", "inactive_file")
_V1 = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")


def _cgroups(proc: Path, root: Path) -> list[Usage]:
    """Every memory cgroup limit that binds this process: its own group's and each ancestor's.

    A limit set on a parent (a systemd slice's `MemoryMax=`, a Kubernetes pod above its
    container) ends the daemon as surely as its own, so every level with a limit is a reading;
    the callers take the fullest. Empty without a limit anywhere (or without cgroups)."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return []
    mounts = _cgroup_mount_roots(proc)
    usages: list[Usage] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one unified hierarchy
            base, files, fs = root, _V2, "cgroup2"
        elif "memory" in controllers.split(","):  # v1: the memory controller's own tree
            base, files, fs = root / "memory", _V1, "memory"
        else:
            continue
        group = _group_dir(base, path, mounts.get(fs))
        for level in _up_to(group, base):
            found = _read(level, *files)
            if found is not None:
                usages.append(found)
    return usages


def _cgroup_mount_roots(proc: Path) -> dict[str, str]:
    """The hierarchy path each cgroup mount shows at its mount point, from mountinfo's root
    field: "cgroup2" for the unified tree, "memory" for v1's memory controller.

    A container that shares the host's cgroup namespace (Docker on a cgroup v1 host,
    Kubernetes on v1 nodes) reads `/docker/<id>` in /proc/self/cgroup, but its own group is
    mounted at /sys/fs/cgroup/memory itself; the root field (`/docker/<id>`) maps one onto the
    other."""
    try:
        lines = (proc / "self" / "mountinfo").read_text().splitlines()
    except OSError:
        return {}
    roots: dict[str, str] = {}
    for line in lines:
        fields, _, tail = line.partition(" - ")
        parts, extra = fields.split(), tail.split()
        if len(parts) < 5 or len(extra) < 3:
            continue
        mount_root = _unescape(parts[3])
        if extra[0] == "cgroup2":
            roots.setdefault("cgroup2", mount_root)
        elif extra[0] == "cgroup" and "memory" in extra[2].split(","):
            roots.setdefault("memory", mount_root)
    return roots


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes (\\040)."""
    for code in ("\\040", "\\011", "\\012", "\\134"):
        field = field.replace(code, chr(int(code[1:], 8)))
    return field


def _group_dir(base: Path, path: str, mount_root: str | None) -> Path:
    """Where the group `path` (as /proc/self/cgroup names it) is under the mount at `base`.

    The mount's root is cut off the front of the path; a path that still is not there (no
    mountinfo, or a namespace that hides the host side) is this process's group mounted at the
    mount root itself, which is what a container runtime mounts."""
    parts = [p for p in path.split("/") if p]
    if mount_root is not None:
        prefix = [p for p in mount_root.split("/") if p]
        if parts[: len(prefix)] == prefix:
            parts = parts[len(prefix) :]
    group = base.joinpath(*parts)
    return group if group.is_dir() else base


def _up_to(group: Path, base: Path) -> list[Path]:
    """`group` and each of its parents up to and including `base`."""
    levels = [group]
    while levels[-1] != base and base in levels[-1].parents:
        levels.append(levels[-1].parent)
    return levels


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
