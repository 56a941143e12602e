//! What a contract test gets: the store under test and, where the backend offers them, an
//! administrator connection, plaintext access and a way to lose all data or let time pass.

use super::*;

/// Plaintext access to a server as its default user: for MONITOR and for bytes sent by hand.
#[derive(Clone, Debug)]
pub struct RawAccess {
    /// The plaintext port.
    pub port: u16,
    /// The default user's password, if any.
    pub password: Option<String>,
}

/// A server (or cluster) under test, with how the store reaches it and how an administrator
/// does.
pub struct ServerEnv {
    /// The server flavour (for a cluster: of its nodes).
    pub kind: ServerKind,
    /// How the store under test connects (ACL user, TLS, cluster seeds, ...).
    pub config: ValkeyConfig,
    /// The administrator's connection.
    pub admin: Admin,
    /// Plaintext access as the default user, when the server offers it.
    pub raw: Option<RawAccess>,
    /// Whatever must live as long as the test: servers, clusters, certificate folders.
    pub keep: Vec<Box<dyn std::any::Any + Send>>,
}

/// An etcd member under test and how the store reaches it.
pub struct EtcdEnv {
    /// The member.
    pub server: EtcdServer,
    /// How the store under test connects.
    pub config: EtcdConfig,
    /// Every key and value as [`Harness::save_snapshot`] found them.
    saved: std::sync::Mutex<Option<Snapshot>>,
}

/// One backend instance for one test.
pub struct Harness {
    /// The store under test.
    pub store: Arc<dyn LeaseStore>,
    memory: Option<(Arc<MemoryStore>, ManualClock)>,
    /// The in-memory store's saved snapshot ([`Harness::save_snapshot`]).
    saved: std::sync::Mutex<Option<MemorySnapshot>>,
    pub(super) env: Option<ServerEnv>,
    etcd: Option<EtcdEnv>,
}

/// A server that stopped replicating the store's data at one moment and then became a primary:
/// a failover to a replica that missed the newest writes. The store on it is the one clients
/// reach after the failover.
pub struct Promoted {
    /// A store on the promoted copy.
    pub store: Arc<dyn LeaseStore>,
    _server: Option<Box<dyn std::any::Any + Send>>,
}

/// A config for a plain test server URL.
pub fn valkey_config(url: &str) -> ValkeyConfig {
    ValkeyConfig::new(SecretUrl::parse(url).expect("test URL parses"))
}

impl Harness {
    /// The in-memory store on a manual clock.
    pub fn memory() -> Harness {
        let clock = ManualClock::new();
        let store = Arc::new(MemoryStore::with_clock(
            Arc::new(clock.clone()),
            Duration::from_secs(60),
        ));
        Harness {
            store: store.clone(),
            memory: Some((store, clock)),
            saved: Default::default(),
            env: None,
            etcd: None,
        }
    }

    /// A store on a one-member etcd cluster of its own.
    pub async fn etcd() -> Harness {
        let server = EtcdServer::start();
        let url = SecretUrl::parse(&server.url()).expect("etcd URL");
        let config = EtcdConfig::new(vec![url]);
        let store = EtcdStore::new(config.clone()).expect("etcd store");
        Harness {
            store: Arc::new(store),
            memory: None,
            saved: Default::default(),
            env: None,
            etcd: Some(EtcdEnv {
                server,
                config,
                saved: Default::default(),
            }),
        }
    }

    /// A store connected to `env` as `env.config` says.
    pub async fn server(env: ServerEnv) -> Harness {
        let store = ValkeyStore::connect(env.config.clone())
            .await
            .unwrap_or_else(|e| panic!("connect to the test server: {e}"));
        Harness {
            store: Arc::new(store),
            memory: None,
            saved: Default::default(),
            env: Some(env),
            etcd: None,
        }
    }

    /// A plain server of `kind`, reached by URL, with raw access (and `DEBUG`, for
    /// [`Harness::restore_snapshot`]).
    pub async fn plain(kind: ServerKind) -> Harness {
        let server = Server::start_with(kind, &["--enable-debug-command", "yes"]);
        let admin = Admin::single(&server.url(), None).await;
        let env = ServerEnv {
            kind,
            config: valkey_config(&server.url()),
            admin,
            raw: Some(RawAccess {
                port: server.port,
                password: None,
            }),
            keep: vec![Box::new(server)],
        };
        Harness::server(env).await
    }

    /// A store on its own pool (the same store for the in-memory backend).
    pub(super) async fn another_connection(&self) -> Arc<dyn LeaseStore> {
        if let Some(etcd) = &self.etcd {
            return Arc::new(EtcdStore::new(etcd.config.clone()).expect("etcd store"));
        }
        match &self.env {
            Some(env) => Arc::new(
                ValkeyStore::connect(env.config.clone())
                    .await
                    .expect("connect"),
            ),
            None => self.store.clone(),
        }
    }

    /// A store whose cached replies expire soon, and how long to let pass until they have:
    /// the in-memory store itself (its manual clock jumps past its 60 s reply TTL), or a second
    /// store on the server with a 1 s reply TTL (and a call timeout that the 4x rule allows).
    pub async fn short_replies(&self) -> (Arc<dyn LeaseStore>, Duration) {
        if let Some(etcd) = &self.etcd {
            let mut config = etcd.config.clone();
            config.reply_ttl = Duration::from_secs(1);
            config.call_timeout = Duration::from_millis(250);
            let store = EtcdStore::new(config).expect("etcd store");
            return (Arc::new(store), Duration::from_millis(1_200));
        }
        match &self.env {
            None => (self.store.clone(), Duration::from_secs(61)),
            Some(env) => {
                let mut config = env.config.clone();
                config.reply_ttl = Duration::from_secs(1);
                config.call_timeout = Duration::from_millis(250);
                let store = ValkeyStore::connect(config).await.expect("connect");
                (Arc::new(store), Duration::from_millis(1_200))
            }
        }
    }

    /// Lets time pass: the manual clock moves, a real server is waited for.
    pub async fn pass(&self, d: Duration) {
        match &self.memory {
            Some((_, clock)) => clock.advance(d),
            None => tokio::time::sleep(d).await,
        }
    }

    /// The store's clock in microseconds: the manual clock, or this machine's clock for a server
    /// on this machine (close enough for tests that keep a minute of margin).
    pub fn clock_micros(&self) -> u64 {
        match &self.memory {
            Some((_, clock)) => clock.now_micros(),
            None => SystemClock.now_micros(),
        }
    }

    /// Loses all data, as FLUSHALL or a restart without persistence does.
    pub async fn wipe(&self) {
        if let Some(etcd) = &self.etcd {
            return etcd.server.wipe();
        }
        match (&self.memory, &self.env) {
            (Some((store, _)), _) => store.forget_everything(),
            (_, Some(env)) => env.admin.flushall().await,
            _ => unreachable!(),
        }
    }

    /// A copy of the data as it is now that misses every later write, promoted to primary
    /// when this returns: a replica linked to the server until it is in sync, then detached
    /// with `REPLICAOF NO ONE` (for the in-memory store, a second store on a copy of its state).
    /// Plain servers and the in-memory store only.
    pub async fn lagging_replica(&self) -> Promoted {
        if let Some(etcd) = &self.etcd {
            // etcd never promotes a member that missed acknowledged writes: the nearest thing
            // is a new cluster restored from a snapshot taken now.
            let copy = EtcdServer::start();
            copy.restore(&etcd.server.all());
            let mut config = etcd.config.clone();
            config.endpoints = vec![SecretUrl::parse(&copy.url()).expect("etcd URL")];
            return Promoted {
                store: Arc::new(EtcdStore::new(config).expect("etcd store")),
                _server: Some(Box::new(copy)),
            };
        }
        if let Some((store, _)) = &self.memory {
            let copy = store.promoted(&store.snapshot());
            return Promoted {
                store: Arc::new(copy),
                _server: None,
            };
        }
        let kind = self.env().kind;
        let port = self.raw().port.to_string();
        let replica = Server::start_with(kind, &["--replicaof", "127.0.0.1", &port]);
        let primary = self
            .env()
            .keep
            .iter()
            .find_map(|k| k.downcast_ref::<Server>())
            .expect("the harness keeps its server");
        assert!(
            replica.wait_in_sync_with(primary, Duration::from_secs(15)),
            "the replica did not catch up"
        );
        let mut replica = replica;
        replica.promote();
        let mut config = self.env().config.clone();
        config.endpoints = targetlease::store::valkey::Endpoints::Single(
            SecretUrl::parse(&replica.url()).expect("replica URL"),
        );
        let store = ValkeyStore::connect(config)
            .await
            .expect("connect to the replica");
        Promoted {
            store: Arc::new(store),
            _server: Some(Box::new(replica)),
        }
    }

    /// Saves a snapshot of the data (`SAVE`) for [`Harness::restore_snapshot`].
    pub async fn save_snapshot(&self) {
        if let Some(etcd) = &self.etcd {
            *etcd.saved.lock().expect("lock") = Some(etcd.server.all());
            return;
        }
        match &self.memory {
            Some((store, _)) => *self.saved.lock().expect("lock") = Some(store.snapshot()),
            None => assert_eq!(self.admin().cmd(&["SAVE"]).await, Value::Okay),
        }
    }

    /// Brings the data back to the saved snapshot, losing every write since, as a restart from
    /// an older snapshot does (`DEBUG RELOAD NOSAVE` on a server).
    pub async fn restore_snapshot(&self) {
        if let Some(etcd) = &self.etcd {
            let saved = etcd.saved.lock().expect("lock");
            return etcd
                .server
                .restore(saved.as_ref().expect("save_snapshot first"));
        }
        match &self.memory {
            Some((store, _)) => {
                let saved = self.saved.lock().expect("lock");
                store.restore(saved.as_ref().expect("save_snapshot first"));
            }
            None => assert_eq!(
                self.admin().cmd(&["DEBUG", "RELOAD", "NOSAVE"]).await,
                Value::Okay
            ),
        }
    }

    /// The server under test (server backends only).
    pub fn env(&self) -> &ServerEnv {
        self.env.as_ref().expect("server backend")
    }

    /// The administrator's connection (server backends only).
    pub fn admin(&self) -> &Admin {
        &self.env().admin
    }

    pub(super) fn raw(&self) -> &RawAccess {
        self.env().raw.as_ref().expect("raw access")
    }

    /// The keys of a target under the store's prefix.
    pub fn keys(&self, t: &TargetRef) -> TargetKeys {
        let prefix = self
            .env
            .as_ref()
            .map_or("tl", |e| e.config.key_prefix.as_str());
        TargetKeys::new(prefix, t)
    }
}
