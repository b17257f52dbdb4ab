"""Real-kernel VM test rig for flexhub (qemu + stock Debian kernel)."""
