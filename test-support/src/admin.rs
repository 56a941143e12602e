//! An administrator's connection to a test server or cluster, separate from the store under
//! test: it plants corrupt records, inspects keys, flushes data, reads replicas. It connects as
//! the default user, over TLS when the server only speaks TLS, and routes by key on a cluster.

use redis::aio::MultiplexedConnection;
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::{Client, RedisResult, TlsCertificates, Value};

/// An administrator's connection.
#[derive(Clone)]
pub enum Admin {
    /// To one server.
    Single(MultiplexedConnection),
    /// To a cluster, routing each command by its key.
    Cluster(ClusterConnection),
}

impl Admin {
    /// Connects to one server by URL (`rediss://` with `certs` for TLS servers).
    pub async fn single(url: &str, certs: Option<TlsCertificates>) -> Admin {
        install_crypto_provider();
        let client = match certs {
            Some(certs) => Client::build_with_tls(url, certs),
            None => Client::open(url),
        }
        .expect("admin client");
        Admin::Single(
            client
                .get_multiplexed_async_connection()
                .await
                .expect("admin connection"),
        )
    }

    /// Connects to a cluster through its seed URLs.
    pub async fn cluster(seeds: &[String]) -> Admin {
        let client = ClusterClientBuilder::new(seeds.to_vec())
            .build()
            .expect("admin cluster client");
        Admin::Cluster(
            client
                .get_async_connection()
                .await
                .expect("admin cluster connection"),
        )
    }

    /// Sends one command.
    pub async fn try_cmd(&self, args: &[&str]) -> RedisResult<Value> {
        let mut cmd = redis::cmd(args[0]);
        for arg in &args[1..] {
            cmd.arg(*arg);
        }
        match self.clone() {
            Admin::Single(mut c) => cmd.query_async(&mut c).await,
            Admin::Cluster(mut c) => cmd.query_async(&mut c).await,
        }
    }

    /// Sends one command; panics on an error reply.
    pub async fn cmd(&self, args: &[&str]) -> Value {
        self.try_cmd(args)
            .await
            .unwrap_or_else(|e| panic!("admin {:?} failed: {e}", args.first()))
    }

    /// A string reply (or nil) as text.
    pub async fn get(&self, key: &str) -> Option<String> {
        redis::from_redis_value(self.cmd(&["GET", key]).await).expect("GET answers a string")
    }

    /// Whether a key exists.
    pub async fn exists(&self, key: &str) -> bool {
        redis::from_redis_value::<i64>(self.cmd(&["EXISTS", key]).await).expect("EXISTS") == 1
    }

    /// Deletes every key (on a cluster: on every primary).
    pub async fn flushall(&self) {
        self.cmd(&["FLUSHALL"]).await;
    }
}

/// rustls needs a process-wide crypto provider before the first TLS connection.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}
