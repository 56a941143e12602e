//! A real Valkey Cluster on loopback ports: three primaries, each with one replica, built by
//! hand (CLUSTER MEET, ADDSLOTSRANGE, REPLICATE) so no `valkey-cli` is needed. A short
//! `cluster-node-timeout` (1000 ms) makes a killed primary's replica take over within seconds.

use std::time::{Duration, Instant};

use super::server::{Server, ServerKind};

/// Slot ranges of the three primaries.
pub const RANGES: [(u16, u16); 3] = [(0, 5460), (5461, 10922), (10923, 16383)];

/// A running cluster; every node is killed on drop.
pub struct Cluster {
    /// Nodes 0..3 start as primaries (owning [`RANGES`]), node 3+i replicates node i.
    pub nodes: Vec<Server>,
    ids: Vec<String>,
}

impl Cluster {
    /// Starts and forms a cluster; returns once every node reports `cluster_state:ok` and every
    /// replica is in sync. Panics with the nodes' view when that takes longer than 30 s.
    pub fn start(kind: ServerKind, extra: &[&str]) -> Cluster {
        let mut args = vec![
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            "1000",
            // Failover must not wait for the replica to have been connected recently.
            "--cluster-replica-validity-factor",
            "0",
            // Replicas sync at once rather than after the default 5 s wait for more replicas.
            "--repl-diskless-sync-delay",
            "0",
        ];
        args.extend_from_slice(extra);
        let nodes: Vec<Server> = (0..6).map(|_| Server::start_with(kind, &args)).collect();
        let ids: Vec<String> = nodes
            .iter()
            .map(|n| bulk(&n.raw(&["CLUSTER", "MYID"])))
            .collect();
        for node in &nodes[1..] {
            let reply = nodes[0].raw(&["CLUSTER", "MEET", "127.0.0.1", &node.port.to_string()]);
            assert!(reply.starts_with("+OK"), "CLUSTER MEET: {reply}");
        }
        for (node, (from, to)) in nodes.iter().zip(RANGES) {
            let reply = node.raw(&[
                "CLUSTER",
                "ADDSLOTSRANGE",
                &from.to_string(),
                &to.to_string(),
            ]);
            assert!(reply.starts_with("+OK"), "ADDSLOTSRANGE: {reply}");
        }
        let cluster = Cluster { nodes, ids };
        // Until a handshake completes, a node lists its peer under a temporary id.
        cluster.wait(
            "every node knows every other by id",
            Duration::from_secs(30),
            |c| {
                c.nodes.iter().all(|n| {
                    let view = n.raw(&["CLUSTER", "NODES"]);
                    c.ids.iter().all(|id| view.contains(id.as_str()))
                })
            },
        );
        for i in 0..3 {
            let reply = cluster.nodes[3 + i].raw(&["CLUSTER", "REPLICATE", &cluster.ids[i]]);
            assert!(reply.starts_with("+OK"), "CLUSTER REPLICATE: {reply}");
        }
        cluster.wait(
            "cluster ok and replicas in sync",
            Duration::from_secs(30),
            |c| {
                c.nodes
                    .iter()
                    .all(|n| n.raw(&["CLUSTER", "INFO"]).contains("cluster_state:ok"))
                    && c.nodes[3..].iter().all(|n| {
                        n.raw(&["INFO", "replication"])
                            .contains("master_link_status:up")
                    })
            },
        );
        cluster
    }

    /// The cluster id of node `index`.
    pub fn id(&self, index: usize) -> &str {
        &self.ids[index]
    }

    /// Moves `slot` from primary `from` to primary `to` the way an operator reshards: mark it
    /// importing and migrating, MIGRATE its keys, then, after `between` ran (clients now get ASK
    /// redirects for the slot), assign it to `to` (clients get MOVED).
    pub async fn move_slot<F: std::future::Future<Output = ()>>(
        &self,
        slot: u16,
        from: usize,
        to: usize,
        between: F,
    ) {
        let slot_arg = slot.to_string();
        let ok = |reply: String, what: &str| assert!(reply.starts_with("+OK"), "{what}: {reply}");
        ok(
            self.nodes[to].raw(&[
                "CLUSTER",
                "SETSLOT",
                &slot_arg,
                "IMPORTING",
                &self.ids[from],
            ]),
            "SETSLOT IMPORTING",
        );
        ok(
            self.nodes[from].raw(&["CLUSTER", "SETSLOT", &slot_arg, "MIGRATING", &self.ids[to]]),
            "SETSLOT MIGRATING",
        );
        let keys = array(&self.nodes[from].raw(&["CLUSTER", "GETKEYSINSLOT", &slot_arg, "1000"]));
        assert!(!keys.is_empty(), "no keys in slot {slot}");
        let port = self.nodes[to].port.to_string();
        let mut migrate = vec!["MIGRATE", "127.0.0.1", &port, "", "0", "5000", "KEYS"];
        migrate.extend(keys.iter().map(String::as_str));
        ok(self.nodes[from].raw(&migrate), "MIGRATE");
        between.await;
        // The new owner first, then the old one, then the remaining primary.
        let mut order = vec![to, from];
        order.extend((0..3).filter(|n| *n != to && *n != from));
        for node in order {
            ok(
                self.nodes[node].raw(&["CLUSTER", "SETSLOT", &slot_arg, "NODE", &self.ids[to]]),
                "SETSLOT NODE",
            );
        }
    }

    /// Seed URLs (every node).
    pub fn seeds(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|n| format!("redis://127.0.0.1:{}", n.port))
            .collect()
    }

    /// The node currently serving `slot` as primary, by asking a live node.
    pub fn primary_of_slot(&mut self, slot: u16) -> usize {
        self.primary_of_slot_if_any(slot)
            .unwrap_or_else(|| panic!("no live primary serves slot {slot}"))
    }

    /// The node a live node sees serving `slot` as a primary that is not failed, if any.
    pub fn primary_of_slot_if_any(&mut self, slot: u16) -> Option<usize> {
        let nodes = self.live_node().raw(&["CLUSTER", "NODES"]);
        for line in nodes.lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.len() < 9 || !fields[2].contains("master") || fields[2].contains("fail") {
                continue;
            }
            let owns = fields[8..].iter().any(|range| {
                let (from, to) = range.split_once('-').unwrap_or((range, range));
                matches!((from.parse::<u16>(), to.parse::<u16>()), (Ok(a), Ok(b)) if a <= slot && slot <= b)
            });
            if owns {
                let id = fields[0];
                return self.ids.iter().position(|i| i == id);
            }
        }
        None
    }

    /// The slot of a key, as the cluster computes it.
    pub fn keyslot(&mut self, key: &str) -> u16 {
        let reply = self.live_node().raw(&["CLUSTER", "KEYSLOT", key]);
        reply
            .trim()
            .trim_start_matches(':')
            .parse()
            .unwrap_or_else(|_| panic!("CLUSTER KEYSLOT answered {reply:?}"))
    }

    fn live_node(&mut self) -> &Server {
        let index = self
            .nodes
            .iter_mut()
            .position(|n| n.is_running())
            .expect("a live node");
        &self.nodes[index]
    }

    fn wait(&self, what: &str, limit: Duration, ready: impl Fn(&Cluster) -> bool) {
        let deadline = Instant::now() + limit;
        while !ready(self) {
            if Instant::now() > deadline {
                let view: Vec<String> = self
                    .nodes
                    .iter()
                    .map(|n| n.raw(&["CLUSTER", "NODES"]))
                    .collect();
                panic!(
                    "cluster: {what} not reached within {limit:?}:\n{}",
                    view.join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// The text of a RESP bulk string reply.
fn bulk(reply: &str) -> String {
    reply
        .lines()
        .nth(1)
        .unwrap_or_else(|| panic!("not a bulk reply: {reply:?}"))
        .to_owned()
}

/// The bulk strings of a RESP array reply.
fn array(reply: &str) -> Vec<String> {
    let lines: Vec<&str> = reply.split("\r\n").collect();
    lines
        .windows(2)
        .filter(|w| w[0].starts_with('$') && w[0] != "$-1")
        .map(|w| w[1].to_owned())
        .collect()
}
