# netns.sh - two network namespaces joined by a veth pair, sourced by
# tools/netbed.sh and tests/twohost.sh. Needs root (CAP_NET_ADMIN) and ip(8).

# netns_pair NS_A NS_B ADDR_A ADDR_B VETH_A VETH_B
# Creates NS_A and NS_B, the pair VETH_A (in NS_A, ADDR_A/24) - VETH_B (in
# NS_B, ADDR_B/24), and brings them and both loopbacks up. Returns 2 when
# NS_A cannot be created (nothing was made: not root, no netns support, or the
# name is taken), 1 when a later step fails (netns_del NS_A NS_B cleans up).
netns_pair() {
    ip netns add "$1" 2>/dev/null || return 2
    ip netns add "$2" || return 1
    ip link add "$5" type veth peer name "$6" || return 1
    ip link set "$5" netns "$1" && ip link set "$6" netns "$2" || return 1
    ip -n "$1" addr add "$3/24" dev "$5" && ip -n "$2" addr add "$4/24" dev "$6" || return 1
    ip -n "$1" link set lo up && ip -n "$2" link set lo up || return 1
    ip -n "$1" link set "$5" up && ip -n "$2" link set "$6" up || return 1
    return 0
}

# netns_del NS ...: removes the namespaces (each takes its veth end, and so
# the pair, with it).
netns_del() {
    local ns
    for ns in "$@"; do ip netns del "$ns" 2>/dev/null || true; done
}
