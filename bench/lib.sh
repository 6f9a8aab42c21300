# Shared by bench scripts: source it after `cd` to the repository root and setting
# TESSERA. Not a benchmark on its own.

# start_node DIR PORT CORES: `tessera up` with its data in DIR, NBD on 127.0.0.1:PORT and
# CORES reactor cores, logging to DIR/node.log. Sets NODE_PID, ends the node and removes
# DIR on exit, and returns once the API answers (or fails, with the node's log).
start_node() {
    local dir=$1 port=$2 cores=$3
    "$TESSERA" up --data-dir "$dir" --nbd "127.0.0.1:$port" --cores "$cores" >"$dir/node.log" 2>&1 &
    await_node "$dir" $!
}

# start_node_with DIR PORT CORES SETTINGS: as start_node, for a node started from a
# config file whose top-level settings are SETTINGS (TOML lines, e.g. "readahead =
# false"); NVMe/TCP off. Run in a subshell (`$(...)`), the node is gone when it ends.
start_node_with() {
    local dir=$1 port=$2 cores=$3 settings=$4
    cat >"$dir/tessera.toml" <<CFG
data_dir = "$dir"
cores = $cores
$settings
[nbd]
listen = ["127.0.0.1:$port"]
[nvmf]
enabled = false
CFG
    "$TESSERA" node --config "$dir/tessera.toml" >"$dir/node.log" 2>&1 &
    await_node "$dir" $!
}

# await_node DIR PID: see start_node.
await_node() {
    local dir=$1
    NODE_PID=$2
    # shellcheck disable=SC2064 # expand now: the values are fixed for the script's life
    trap "kill $NODE_PID 2>/dev/null; wait $NODE_PID 2>/dev/null; rm -rf '$dir'" EXIT
    for _ in $(seq 200); do
        [[ -S "$dir/api.sock" ]] && "$TESSERA" --api "unix:$dir/api.sock" pool list >/dev/null 2>&1 && return 0
        kill -0 "$NODE_PID" 2>/dev/null || break
        sleep 0.1
    done
    echo "the node did not answer on $dir/api.sock; its log:" >&2
    cat "$dir/node.log" >&2
    return 1
}
