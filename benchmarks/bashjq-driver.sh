#!/bin/bash
# Baseline for the benchmark: what a typical bash+jq FlexVolume driver does on `mount` of a
# directory that is already mounted: five jq extractions and a findmnt. Not a driver to use.
#   bashjq-driver.sh mount <dir> <json>
set -u
if [ "${1:-}" != "mount" ] || [ "$#" -ne 3 ]; then
    echo '{"status":"Not supported"}'
    exit 1
fi
dir=$2
json=$3
backend=$(echo "$json" | jq -r '.backend // ""')
file=$(echo "$json" | jq -r '.file // ""')
fstype=$(echo "$json" | jq -r '.["kubernetes.io/fsType"] // ""')
readwrite=$(echo "$json" | jq -r '.["kubernetes.io/readwrite"] // "rw"')
options=$(echo "$json" | jq -r '.mountOptions // ""')
if [ -z "$backend" ] || [ -z "$file" ]; then
    echo '{"status":"Failure","message":"backend and file are required"}'
    exit 1
fi
if findmnt -n -M "$dir" >/dev/null 2>&1; then
    echo '{"status":"Success"}'
    exit 0
fi
echo "{\"status\":\"Failure\",\"message\":\"not mounted: $fstype $readwrite $options\"}"
exit 1
