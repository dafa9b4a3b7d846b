#!/bin/sh
# Stand-in for the real sandbox-agent (a static Rust binary) until it exists:
# installed as /sbin/sandbox-agent it boots an image the way the agent will
# (PID 1; proc/sys/dev; writable overlay root on a size-capped tmpfs;
# pivot_root) and then echoes lines on the `agent` virtio-serial port so the
# host side can be exercised. Uses only tools of Debian minbase (dash,
# util-linux, coreutils).
set -u
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
grep -q ' /dev ' /proc/mounts || mount -t devtmpfs devtmpfs /dev

size=$(sed -n 's/.*agent_sandbox.overlay_size=\([^ ]*\).*/\1/p' /proc/cmdline)
mount -t tmpfs -o "size=${size:-1g},mode=0755" overlay-tmpfs /mnt
mkdir -p /mnt/upper /mnt/work /mnt/root
mount -t overlay -o lowerdir=/,upperdir=/mnt/upper,workdir=/mnt/work overlay /mnt/root
mkdir -p /mnt/root/.oldroot
for m in proc sys dev; do mount -n --move "/$m" "/mnt/root/$m"; done
cd /mnt/root
pivot_root . .oldroot
umount -l /.oldroot
rmdir /.oldroot 2>/dev/null
mount -t tmpfs -o mode=1777 tmpfs /tmp
mkdir -p /dev/pts && mount -t devpts -o newinstance,ptmxmode=0666 devpts /dev/pts
hostname "$(cat /etc/hostname)"
echo "placeholder-agent: up $(cut -d' ' -f1 /proc/uptime)s"

port=
for d in /sys/class/virtio-ports/*; do
	[ "$(cat "$d/name" 2>/dev/null)" = agent ] && port=/dev/${d##*/}
done
if [ -z "$port" ]; then
	echo "placeholder-agent: no virtio-serial port named agent" >&2
	exec sleep infinity
fi
# One open file description for both directions: the port allows a single
# opener. Say hello once (bytes written while no host is connected reach the
# next client), then echo. read() gives EOF while no host is connected, so
# back off instead of spinning.
exec 3<>"$port"
echo "hello placeholder-agent" >&3
while :; do
	cat <&3 >&3
	sleep 0.2
done
