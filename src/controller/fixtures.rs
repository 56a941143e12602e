//! Fixtures for reconcile unit tests: a [`Context`] over the in-memory store and a mocked API
//! server (as kube-rs's controller-rs tests its reconciler). The test plays the API server: it
//! takes each request the reconcile sends, in order, checks it, and answers it, so a test can
//! look at the store between two requests (was anything released before the status left
//! Held?) and answer any request with a refusal (409, 403, 404).

use std::sync::Arc;
use std::time::Duration;

use http::{Method, Request, Response, StatusCode};
use kube::Client;
use kube::client::Body;
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::store::Writer;
use kube::runtime::reflector::{self, ObjectRef};
use serde_json::{Value, json};
use tokio::sync::mpsc::{self, UnboundedReceiver};
use tower_test::mock::{Handle, SendResponse};

use super::context::{Context, Parts};
use super::holders::{Holders, PodScope};
use super::installation::Installations;
use super::line::Line;
use super::metrics::Metrics;
use super::status::StatusWriter;
use super::tenure::{self, Tenures};
use crate::api::{FINALIZER, TargetLease, TargetLeaseSpec, TargetLeaseStatus};
use crate::election::Leadership;
use crate::store::memory::MemoryStore;
use crate::store::{Inspection, LeaseStore, TargetRef};

/// How long a test waits for the next request before it fails (a reconcile that sends nothing
/// more, or hangs).
const PATIENCE: Duration = Duration::from_secs(5);

/// One request the reconcile sent, and the way to answer it.
pub(crate) struct Sent {
    pub(crate) method: Method,
    /// The path and query.
    pub(crate) uri: String,
    /// The body, as JSON (`Null` when empty).
    pub(crate) body: Value,
    reply: SendResponse<Response<Body>>,
}

impl Sent {
    /// Answers with `code` and `body`.
    pub(crate) fn answer(self, code: StatusCode, body: &Value) {
        let bytes = serde_json::to_vec(body).expect("JSON");
        let response = Response::builder()
            .status(code)
            .header("content-type", "application/json")
            .body(Body::from(bytes))
            .expect("response");
        self.reply.send_response(response);
    }

    /// Answers with a refusal of the API server (`Status` of `code`).
    pub(crate) fn refuse(self, code: u16, reason: &str) {
        let status = json!({
            "kind": "Status", "apiVersion": "v1", "status": "Failure",
            "message": format!("refused by the test: {reason}"), "reason": reason, "code": code,
        });
        self.answer(StatusCode::from_u16(code).expect("code"), &status);
    }
}

/// The API server the test plays. Events are published in tasks of their own, so they may come
/// before or after the requests that follow their status write: the server answers each Event
/// when it comes and keeps its reason for [`ApiServer::event`].
pub(crate) struct ApiServer {
    handle: Handle<Request<Body>, Response<Body>>,
    events: std::collections::VecDeque<String>,
    /// Requests that came while the test waited for an Event, in their order.
    pending: std::collections::VecDeque<Sent>,
}

impl ApiServer {
    /// The next request the reconcile sends, Events aside.
    pub(crate) async fn next(&mut self) -> Sent {
        if let Some(sent) = self.pending.pop_front() {
            return sent;
        }
        loop {
            let sent = self.any().await;
            if sent.method == Method::POST && sent.uri.contains("/events") {
                self.answer_event(sent);
                continue;
            }
            return sent;
        }
    }

    fn answer_event(&mut self, sent: Sent) {
        let reason = sent.body["reason"].as_str().unwrap_or_default().to_owned();
        let body = sent.body.clone();
        sent.answer(StatusCode::CREATED, &body);
        self.events.push_back(reason);
    }

    /// The next request of any kind.
    async fn any(&mut self) -> Sent {
        let (request, reply) = tokio::time::timeout(PATIENCE, self.handle.next_request())
            .await
            .expect("no request to the API server in time")
            .expect("the client is gone");
        let method = request.method().clone();
        let uri = request
            .uri()
            .path_and_query()
            .map(|p| p.to_string())
            .unwrap_or_default();
        let bytes = request
            .into_body()
            .collect_bytes()
            .await
            .expect("request body");
        let body = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).expect("a JSON body")
        };
        Sent {
            method,
            uri,
            body,
            reply,
        }
    }

    /// The next request, which must be a status write (server-side apply of `.../status`) of
    /// `lease`: answered by the caller.
    pub(crate) async fn status_write(&mut self, lease: &TargetLease) -> (TargetLeaseStatus, Sent) {
        let sent = self.next().await;
        let name = lease.metadata.name.as_deref().unwrap_or_default();
        assert_eq!(sent.method, Method::PATCH, "{}", sent.uri);
        assert!(
            sent.uri.contains(&format!("/targetleases/{name}/status")),
            "not a status write: {}",
            sent.uri
        );
        assert_eq!(
            sent.body["metadata"]["resourceVersion"].as_str(),
            lease.metadata.resource_version.as_deref(),
            "a status write without the resourceVersion it was decided on"
        );
        let status =
            serde_json::from_value(sent.body["status"].clone()).expect("a TargetLease status");
        (status, sent)
    }

    /// The next request is a status write of `lease`, which the API server applies: answers
    /// with the object as written (the status replaced, a new resourceVersion).
    pub(crate) async fn write_status(&mut self, lease: &TargetLease) -> TargetLease {
        let (status, sent) = self.status_write(lease).await;
        let mut written = lease.clone();
        written.status = Some(status);
        let version = written
            .metadata
            .resource_version
            .as_deref()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
        written.metadata.resource_version = Some((version + 1).to_string());
        sent.answer(
            StatusCode::OK,
            &serde_json::to_value(&written).expect("JSON"),
        );
        written
    }

    /// The reason of the oldest Event not yet asked for (each answered as created when it came);
    /// other requests that come meanwhile wait for [`ApiServer::next`].
    pub(crate) async fn event(&mut self) -> String {
        loop {
            if let Some(reason) = self.events.pop_front() {
                return reason;
            }
            let sent = self.any().await;
            if sent.method == Method::POST && sent.uri.contains("/events") {
                self.answer_event(sent);
            } else {
                self.pending.push_back(sent);
            }
        }
    }

    /// The next request is the removal of `lease`'s finalizer: answered as applied.
    pub(crate) async fn remove_finalizer(&mut self, lease: &TargetLease) {
        let sent = self.next().await;
        let name = lease.metadata.name.as_deref().unwrap_or_default();
        assert_eq!(sent.method, Method::PATCH, "{}", sent.uri);
        let path = sent.uri.split('?').next().unwrap_or_default();
        assert!(
            path.ends_with(&format!("/targetleases/{name}")),
            "{}",
            sent.uri
        );
        assert!(
            sent.body.to_string().contains("remove"),
            "not a removal: {}",
            sent.body
        );
        let mut gone = lease.clone();
        gone.metadata.finalizers = None;
        sent.answer(StatusCode::OK, &serde_json::to_value(&gone).expect("JSON"));
    }

    /// Nothing more is sent for a while, and no Event was left unasked for.
    pub(crate) async fn quiet(&mut self) {
        assert!(
            self.events.is_empty(),
            "unexpected Events: {:?}",
            self.events
        );
        if let Some(sent) = self.pending.front() {
            panic!("unexpected request: {} {}", sent.method, sent.uri);
        }
        let next =
            tokio::time::timeout(Duration::from_millis(200), self.handle.next_request()).await;
        if let Ok(Some((request, _))) = next {
            panic!("unexpected request: {} {}", request.method(), request.uri());
        }
    }
}

/// A controller's context for one test, the API server it talks to, its cache, store and the
/// claims it wakes.
pub(crate) struct Fixture {
    pub(crate) ctx: Arc<Context>,
    pub(crate) api: ApiServer,
    pub(crate) store: Arc<MemoryStore>,
    cache: Writer<TargetLease>,
    pub(crate) woken: UnboundedReceiver<ObjectRef<TargetLease>>,
}

impl Fixture {
    /// A fresh context watching pods everywhere (the default scope); its tenure layer keeps
    /// tenures but renews nothing (no scheduler runs).
    pub(crate) fn new() -> Self {
        let (mock, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let client = Client::new(mock, "default");
        let (leases, cache) = reflector::store();
        let (wake, woken) = mpsc::unbounded_channel();
        let store = Arc::new(MemoryStore::new());
        let metrics = Arc::new(Metrics::new());
        let leadership = Leadership::unconditional();
        let (tenures, _not_scheduled) = Tenures::new(tenure::Wiring {
            store: store.clone(),
            metrics: metrics.clone(),
            leadership: leadership.clone(),
            wake: wake.clone(),
            concurrency: 1,
            leases: leases.clone(),
        });
        let reporter = Reporter {
            controller: "test".into(),
            instance: None,
        };
        let ctx = Context::new(Parts {
            status: StatusWriter::new(
                client.clone(),
                Recorder::new(client.clone(), reporter),
                metrics.clone(),
                leadership.clone(),
            ),
            holders: Holders::new(client.clone(), PodScope::Watched, wake.clone()),
            line: Line::new(leases, wake),
            installations: Installations::acting_in(client.clone(), "test", &["ns"]),
            client,
            store: store.clone(),
            tenures,
            leadership,
            metrics,
            shortest_ttl: Duration::from_secs(1),
            removed: Arc::default(),
        });
        Self {
            ctx: Arc::new(ctx),
            api: ApiServer {
                handle,
                events: std::collections::VecDeque::new(),
                pending: std::collections::VecDeque::new(),
            },
            store,
            cache,
            woken,
        }
    }

    /// Puts `lease` in the controller's cache (as its watch would).
    pub(crate) fn cache(&mut self, lease: &TargetLease) {
        let event = kube::runtime::watcher::Event::Apply(lease.clone());
        self.cache.apply_watcher_event(&event);
        self.ctx.line.observe(&event);
    }

    /// What the store holds for `target` in namespace `ns`.
    pub(crate) async fn inspect(&self, target: &str) -> Inspection {
        let target = TargetRef::new("ns", target).expect("target");
        self.store.inspect(&target).await.expect("inspect")
    }
}

/// A TargetLease `name` in namespace `ns` with `spec`, the controller's finalizer and
/// resourceVersion 1.
pub(crate) fn claim(name: &str, spec: TargetLeaseSpec) -> TargetLease {
    let mut lease = TargetLease::new(name, spec);
    lease.metadata.namespace = Some("ns".into());
    lease.metadata.uid = Some(format!("uid-{name}"));
    lease.metadata.generation = Some(1);
    lease.metadata.resource_version = Some("1".into());
    lease.metadata.finalizers = Some(vec![FINALIZER.into()]);
    lease
}
