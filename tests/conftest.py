import os

# Keep XLA from grabbing every core on small CI machines; tests that need several devices run in
# a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=8.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
