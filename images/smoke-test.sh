#!/bin/bash
# Boot a kernel + rootfs under QEMU (TCG unless --kvm) with no network
# device and check what the guest agent relies on: erofs root, 6.1 kernel,
# virtio-serial port named `agent` reachable from the host, tmpfs + overlay
# root with pivot_root, cgroup2 controllers, and the template's warm
# commands and tests (so python3 and plain `pip install` work in the python
# image, etc.).
#   smoke-test.sh [--kvm] [--timeout S] KERNEL ROOTFS.erofs
# The guest runs a generated test script instead of the agent:
#   init=/bin/sh /dev/vdb   (the script is a second, raw virtio disk; the
# kernel hands bare words it does not know to init as arguments. No "--":
# QEMU appends its virtio_mmio.device= entries after it).
# Prints "SMOKE ..." lines and figures; exits 0 when every check passed.
set -euo pipefail
LOG_TAG=smoke
. "$(dirname "$0")/lib.sh"

accel=tcg
cpu=max
timeout=240
while [ $# -gt 0 ]; do
	case $1 in
	--kvm) accel=kvm; cpu=host; shift ;;
	--timeout) timeout=$2; shift 2 ;;
	-*) die "unknown option $1" ;;
	*) break ;;
	esac
done
kernel=${1:?usage: smoke-test.sh [--kvm] [--timeout S] KERNEL ROOTFS}
rootfs=${2:?usage: smoke-test.sh [--kvm] [--timeout S] KERNEL ROOTFS}
[ -f "$kernel" ] || die "$kernel: no such kernel"
[ -f "$rootfs" ] || die "$rootfs: no such image"
ensure_packages qemu-system-x86 python3 jq

# Template env and warm commands come from the image's manifest (host side).
manifest=$rootfs.json
if [ -f "$manifest" ]; then
	template=$(jq -c .template "$manifest")
else
	template='{"name":"unknown","env":{},"warm":[]}'
fi
memory=$(jq -r '.memory_mib // 512' <<<"$template")
[ "$memory" -ge 256 ] || memory=256

work=$(mktemp -d /tmp/agent-sandbox-smoke.XXXXXX)
trap 'rm -rf "$work"' EXIT

{
	cat <<'SH'
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
say() { echo "SMOKE $*"; }
mount -t proc proc /proc
say init uptime=$(cut -d' ' -f1 /proc/uptime)
mount -t sysfs sysfs /sys
say kernel=$(uname -r)
say rootfs=$(awk '$2 == "/" { print $3 }' /proc/mounts)
grep -q ' /dev devtmpfs ' /proc/mounts && say devtmpfs=ok
for d in /sys/class/virtio-ports/*; do
	n=$(cat "$d/name" 2>/dev/null)
	say port=${d##*/}:$n
	[ "$n" = agent ] && port=/dev/${d##*/}
done
say netdevs=$(ls /sys/class/net | tr '\n' ',')
mount -t tmpfs -o size=512m,mode=0755 overlay-tmpfs /mnt && say tmpfs=ok
mkdir -p /mnt/upper /mnt/work /mnt/root
mount -t overlay -o lowerdir=/,upperdir=/mnt/upper,workdir=/mnt/work overlay /mnt/root && say overlay=ok
mkdir -p /mnt/root/.oldroot
for m in proc sys dev; do mount -n --move /$m /mnt/root/$m; done
cd /mnt/root && pivot_root . .oldroot && cd / && umount -l /.oldroot && say pivot_root=ok
mount -t tmpfs -o mode=1777 tmpfs /tmp
mkdir -p /dev/pts && mount -t devpts -o newinstance,ptmxmode=0666 devpts /dev/pts && say devpts=ok
echo written >/etc/smoke-write && [ "$(cat /etc/smoke-write)" = written ] && say root_writable=ok
say root_after_pivot=$(awk '$2 == "/" { print $3 }' /proc/mounts)
mkdir -p /sys/fs/cgroup && mount -t cgroup2 cgroup2 /sys/fs/cgroup &&
	say cgroup2=$(tr ' ' ',' </sys/fs/cgroup/cgroup.controllers)
say hostname=$(cat /etc/hostname) workspace=$([ -d /workspace ] && echo ok) agent=$([ -x /sbin/sandbox-agent ] && echo ok)
if [ -n "${port:-}" ]; then
	echo "agent-port-ok from $(uname -r)" >"$port" && say port_write=ok
fi
say warm_start uptime=$(cut -d' ' -f1 /proc/uptime)
SH
	# Environment of the template, then each warm command timed.
	jq -r '.env | to_entries[] | "export \(.key)=\(.value | @sh)"' <<<"$template"
	i=0
	while IFS= read -r cmd; do
		i=$((i + 1))
		printf 't0=$(date +%%s%%N); if ( %s ) >/tmp/warm.out 2>&1; then say warm%d=ok ms=$(( ($(date +%%s%%N) - t0) / 1000000 )); else say warm%d=FAIL; tail -n5 /tmp/warm.out; fi\n' "$cmd" "$i" "$i"
	done < <(jq -r '.warm[]' <<<"$template")
	i=0
	while IFS= read -r cmd; do
		i=$((i + 1))
		printf 'if ( %s ) >/tmp/test.out 2>&1; then say test%d=ok; else say test%d=FAIL; tail -n5 /tmp/test.out; fi\n' "$cmd" "$i" "$i"
	done < <(jq -r '(.tests // [])[]' <<<"$template")
	echo 'say done uptime=$(cut -d" " -f1 /proc/uptime)'
	# PID 1 exiting panics; CONFIG_PANIC_TIMEOUT=-1 reboots, -no-reboot exits QEMU.
	echo 'exit 0'
} >"$work/test.sh"
# A raw disk must be whole sectors: pad with newlines, which sh ignores.
python3 - "$work/test.sh" <<'PY'
import sys
p = sys.argv[1]
data = open(p, "rb").read()
open(p, "ab").write(b"\n" * (-len(data) % 4096))
PY
nwarm=$(jq '.warm | length' <<<"$template")
ntests=$(jq '.tests // [] | length' <<<"$template")

qemu=(qemu-system-x86_64 -M microvm,acpi=off -accel "$accel" -cpu "$cpu" -m "$memory" -smp 1
	-nographic -no-reboot -nodefaults -serial stdio
	-kernel "$kernel"
	-append "console=ttyS0 quiet reboot=t root=/dev/vda ro rootfstype=erofs init=/bin/sh /dev/vdb"
	-drive "id=root,file=$rootfs,format=raw,if=none,readonly=on" -device virtio-blk-device,drive=root
	-drive "id=test,file=$work/test.sh,format=raw,if=none,readonly=on" -device virtio-blk-device,drive=test
	-device virtio-serial-device
	-chardev "socket,id=c0,path=$work/agent.sock,server=on,wait=off"
	-device virtserialport,chardev=c0,name=agent)

log "booting $(basename "$kernel") + $(basename "$rootfs") ($accel, ${memory} MiB, $nwarm warm commands, $ntests tests)"
python3 - "$work" "$timeout" "$nwarm" "$ntests" "${qemu[@]}" <<'PY'
import os, socket, subprocess, sys, threading, time

work, timeout, nwarm, ntests, cmd = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:]
t0 = time.monotonic()
proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
port_data = bytearray()

def read_port():
    path = os.path.join(work, "agent.sock")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(path)
            break
        except OSError:
            time.sleep(0.02)
    else:
        return
    s.settimeout(1.0)
    while proc.poll() is None:
        try:
            b = s.recv(4096)
        except socket.timeout:
            continue
        except OSError:
            return
        if not b:
            return
        port_data.extend(b)

threading.Thread(target=read_port, daemon=True).start()
killer = threading.Timer(timeout, proc.kill)
killer.start()
smoke, first, lines = {}, None, []
for raw in proc.stdout:
    line = raw.decode(errors="replace").rstrip("\r\n")
    lines.append(line)
    now = time.monotonic() - t0
    if line.startswith("SMOKE "):
        if first is None:
            first = now
        print(f"{now:7.2f}s {line}", flush=True)
        for kv in line[6:].split():
            if "=" in kv:
                k, v = kv.split("=", 1)
                smoke.setdefault(k, v)
        if line.startswith("SMOKE warm"):
            smoke.setdefault("_warm", []).append(line)
proc.wait()
killer.cancel()
total = time.monotonic() - t0
time.sleep(0.1)

checks = [
    ("kernel is 6.1", smoke.get("kernel", "").startswith("6.1.")),
    ("root is erofs", smoke.get("rootfs") == "erofs"),
    ("devtmpfs mounted", smoke.get("devtmpfs") == "ok"),
    ("port named agent", any(l.endswith(":agent") for l in lines if l.startswith("SMOKE port="))),
    ("no network device but lo", smoke.get("netdevs", "").strip(",") in ("", "lo")),
    ("tmpfs", smoke.get("tmpfs") == "ok"),
    ("overlay", smoke.get("overlay") == "ok"),
    ("pivot_root", smoke.get("pivot_root") == "ok"),
    ("root writable through overlay", smoke.get("root_writable") == "ok"),
    ("root is overlay after pivot", smoke.get("root_after_pivot") == "overlay"),
    ("devpts", smoke.get("devpts") == "ok"),
    ("cgroup2 cpu,memory,pids,io", all(c in smoke.get("cgroup2", "").split(",") for c in ("cpu", "memory", "pids", "io"))),
    ("image layout (hostname, /workspace, agent)", smoke.get("workspace") == "ok" and smoke.get("agent") == "ok"),
    ("host read the agent port", b"agent-port-ok" in port_data),
    (f"{nwarm} warm commands ok", sum(1 for l in lines if l.startswith("SMOKE warm") and "=ok" in l) == nwarm),
    (f"{ntests} template tests ok", sum(1 for l in lines if l.startswith("SMOKE test") and "=ok" in l) == ntests),
    ("guest finished", "done" in " ".join(lines)),
]
failed = [name for name, ok in checks if not ok]
for name, ok in checks:
    print(f"  [{'ok' if ok else 'FAIL'}] {name}")
if failed:
    print("---- console ----")
    print("\n".join(lines[-60:]))
print(f"FIGURES first_init_line_host_s={first if first is None else round(first, 3)} "
      f"guest_uptime_at_init_s={smoke.get('uptime')} total_s={total:.2f}")
sys.exit(1 if failed else 0)
PY
