# shellcheck shell=sh
# Sourced by the recipes that run in calls of at most BUDGET seconds of training (the device tool's 10-minute
# commands, or a CPU session that may end): each call goes on from where the last one stopped.
# Needs BUDGET (seconds per call), PYTHON and DEVICE set; `started` is this call's start.
started=$(date +%s)

ended() {  # the run in folder $1 reached its --steps
    grep -q '"stopped": "steps"' "$1/train.jsonl" 2>/dev/null
}

# resumable FOLDER COMMAND...: this call's share of the run in FOLDER: resumed when it has a save, else started as
# COMMAND... --time-budget LEFT. Status 0: the run has ended; 1: it goes on in the next call; 2: it failed.
resumable() {
    folder=$1
    shift
    ended "$folder" && return 0
    left=$((BUDGET - $(date +%s) + started))
    [ "$left" -ge 60 ] || { echo "$folder goes on in the next call" >&2; return 1; }
    if [ -f "$folder/resume.safetensors" ]; then
        "$PYTHON" -m training text-train --resume --out "$folder" --time-budget "$left" --device "$DEVICE" \
            --no-progress || return 2
    else
        "$@" --time-budget "$left" || return 2
    fi
    ended "$folder" || { echo "$folder goes on in the next call" >&2; return 1; }
}

after() {  # after a run that has not ended: status 1 (it goes on) ends this call with 0, status 2 with 2
    [ "$1" -eq 1 ] && exit 0
    exit 2
}
