"""Prints what a lock file is resolved for: implementation, Python minor version, OS and machine
(`cpython 3.11 linux x86_64`). .ci/lock writes it into the lock's header; .ci/setup-venv compares."""

import platform
import sys

print(f"{sys.implementation.name} {sys.version_info[0]}.{sys.version_info[1]} {sys.platform} {platform.machine()}")
