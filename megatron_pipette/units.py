"""Binary byte units, defined once: memory is reported in GiB as torch and nvidia-smi do."""

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
