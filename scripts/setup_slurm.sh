#!/usr/bin/env bash
# Installs what the Slurm tests need: Debian's Slurm 22.05 (slurmctld, slurmd, client), munge, the
# ShellCheck linter, iproute2 for the two-node cluster's namespaces, and g++, with which torch.compile's
# CPU backend builds its kernels (tests/unit/test_compile.py). Root with apt-get only;
# elsewhere it says so, and the Slurm tests skip (under CI they fail).
# dpkg must not start the daemons (there is no init system): launch/slurm/local_cluster.sh does.
set -euo pipefail
packages=(slurm-wlm slurmctld slurmd slurm-client munge shellcheck iproute2 g++)
if command -v sbatch >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null &&
  command -v shellcheck >/dev/null && command -v ip >/dev/null && command -v g++ >/dev/null; then
  exit 0
fi
if [[ $(id -u) != 0 ]] || ! command -v apt-get >/dev/null; then
  echo "[setup] Slurm not installed and this is not root with apt-get: the Slurm tests will skip" >&2
  echo "[setup] (as root on Debian/Ubuntu: bash scripts/setup_slurm.sh)" >&2
  exit 0
fi
echo "[setup] installing ${packages[*]} with apt-get"
policy=/usr/sbin/policy-rc.d
created=0
if [[ ! -e $policy ]]; then
  printf '#!/bin/sh\nexit 101\n' >"$policy"
  chmod +x "$policy"
  created=1
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
[[ $created == 0 ]] || rm -f "$policy"
