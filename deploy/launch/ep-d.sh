#!/usr/bin/env bash
# Mode ep-d: hops encode+prefill decode. See common.sh for the settings (NATS_URL, MODEL, <ROLE>_WORKERS, ...).
source "$(dirname "$0")/common.sh"
launch_mode ep-d encode+prefill decode
