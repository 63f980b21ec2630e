"""The host memory signal finds the cgroup limit that binds the daemon wherever it is set.

The trees are laid out as the kernel shows them (/proc/self/cgroup, /proc/self/mountinfo and the
cgroup files), under a temporary root: this host cannot create a limited cgroup for a test.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvguard.engine.host_memory import host_memory_used_ratio, room_bytes

GIB = 1 << 30
HOST_KB = 64 * GIB // 1024  # a 64 GiB host with 56 GiB available: 0.125 used


def fake_proc(tmp: Path, cgroup: str, mountinfo: str | None = None) -> Path:
    proc = tmp / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(
        f"MemTotal: {HOST_KB} kB\nMemFree: {HOST_KB * 7 // 8} kB\n"
        f"MemAvailable: {HOST_KB * 7 // 8} kB\n"
    )
    (proc / "self" / "cgroup").write_text(cgroup)
    if mountinfo is not None:
        (proc / "self" / "mountinfo").write_text(mountinfo)
    return proc


def v1_group(group: Path, limit: int | str, usage: int) -> None:
    group.mkdir(parents=True, exist_ok=True)
    (group / "memory.limit_in_bytes").write_text(f"{limit}\n")
    (group / "memory.usage_in_bytes").write_text(f"{usage}\n")
    (group / "memory.stat").write_text("cache 0\ntotal_inactive_file 0\n")


def v2_group(group: Path, limit: int | str, usage: int) -> None:
    group.mkdir(parents=True, exist_ok=True)
    (group / "memory.max").write_text(f"{limit}\n")
    (group / "memory.current").write_text(f"{usage}\n")
    (group / "memory.stat").write_text("anon 0\ninactive_file 0\n")


V1_CONTAINER_CGROUP = (
    "12:memory:/docker/0123abcd\n11:cpu,cpuacct:/docker/0123abcd\n0::/docker/0123abcd\n"
)
V1_CONTAINER_MOUNTS = (
    "1201 1200 0:45 / / rw,relatime - overlay overlay rw\n"
    "1210 1200 0:50 / /sys/fs/cgroup rw,nosuid - tmpfs tmpfs rw,mode=755\n"
    "1215 1210 0:31 /docker/0123abcd /sys/fs/cgroup/memory ro,nosuid,nodev,noexec,relatime "
    "master:15 - cgroup cgroup rw,memory\n"
    "1216 1210 0:32 /docker/0123abcd /sys/fs/cgroup/cpu,cpuacct ro,nosuid,nodev,noexec,relatime "
    "master:16 - cgroup cgroup rw,cpu,cpuacct\n"
)


@pytest.mark.parametrize(
    "mountinfo", [V1_CONTAINER_MOUNTS, None], ids=["mountinfo", "no-mountinfo"]
)
def test_a_container_on_a_cgroup_v1_host_reads_the_group_mounted_for_it(
    tmp_path: Path, mountinfo: str | None
) -> None:
    """Docker/Kubernetes on a v1 host without a cgroup namespace: /proc/self/cgroup names the
    host's path, the container's group is mounted at /sys/fs/cgroup/memory itself."""
    root = tmp_path / "cg"
    v1_group(root / "memory", 4 * GIB, int(3.9 * GIB))
    proc = fake_proc(tmp_path, V1_CONTAINER_CGROUP, mountinfo)
    assert host_memory_used_ratio(proc, root) == pytest.approx(0.975)
    assert room_bytes(0.95, proc, root) == 0


def test_mountinfo_maps_a_sub_group_of_the_container(tmp_path: Path) -> None:
    """The daemon in a child group of its container: the mount root is cut off the path, so the
    child's own (tighter) limit is read as well as the container's above it."""
    root = tmp_path / "cg"
    v1_group(root / "memory", 4 * GIB, 2 * GIB)
    v1_group(root / "memory" / "kvguard", GIB, int(0.98 * GIB))
    proc = fake_proc(tmp_path, "12:memory:/docker/0123abcd/kvguard\n", V1_CONTAINER_MOUNTS)
    assert host_memory_used_ratio(proc, root) == pytest.approx(0.98)
    assert room_bytes(0.95, proc, root) == 0
    assert room_bytes(0.99, proc, root) == int(0.99 * GIB) - int(0.98 * GIB)


def test_a_v2_limit_on_the_parent_slice_binds_the_service(tmp_path: Path) -> None:
    """`Slice=ml.slice` with `MemoryMax=4G` on the slice: the service's own memory.max is max."""
    root = tmp_path / "cg"
    v2_group(root / "ml.slice", 4 * GIB, int(3.9 * GIB))
    v2_group(root / "ml.slice" / "kvguard.service", "max", int(3.9 * GIB))
    proc = fake_proc(tmp_path, "0::/ml.slice/kvguard.service\n")
    assert host_memory_used_ratio(proc, root) == pytest.approx(0.975)
    assert room_bytes(0.95, proc, root) == 0
    # both limited: the fullest one binds, each read with its own usage
    v2_group(root / "ml.slice" / "kvguard.service", 8 * GIB, GIB)
    assert host_memory_used_ratio(proc, root) == pytest.approx(0.975)
    v2_group(root / "ml.slice", 4 * GIB, GIB)
    assert host_memory_used_ratio(proc, root) == pytest.approx(0.25)
    assert room_bytes(0.5, proc, root) == GIB


def test_a_v2_container_sharing_the_hosts_cgroup_namespace(tmp_path: Path) -> None:
    """`docker run --cgroupns=host` on a v2 host: the container's scope is mounted at
    /sys/fs/cgroup, mountinfo's root field names it."""
    root = tmp_path / "cg"
    v2_group(root, 2 * GIB, int(1.5 * GIB))
    scope = "/system.slice/docker-0123abcd.scope"
    mounts = f"1300 1200 0:27 {scope} /sys/fs/cgroup ro,nosuid,relatime - cgroup2 cgroup2 rw\n"
    proc = fake_proc(tmp_path, f"0::{scope}\n", mounts)
    assert host_memory_used_ratio(proc, root) == pytest.approx(0.75)


def test_no_limit_anywhere_is_the_hosts_ratio(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    v1_group(root / "memory", "9223372036854771712", GIB)  # v1's "unlimited"
    v1_group(root / "memory" / "box", "9223372036854771712", GIB)
    proc = fake_proc(tmp_path, "4:memory:/box\n0::/\n")
    assert host_memory_used_ratio(proc, root) == pytest.approx(0.125)
