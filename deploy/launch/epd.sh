#!/usr/bin/env bash
# Mode epd: hops encode+prefill+decode. See common.sh for the settings (NATS_URL, MODEL, <ROLE>_WORKERS, ...).
source "$(dirname "$0")/common.sh"
launch_mode epd encode+prefill+decode
