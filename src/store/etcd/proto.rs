//! The etcd v3 API messages this backend sends and reads (`etcdserverpb/rpc.proto`,
//! `authpb`/`mvccpb` of etcd 3.5 to 3.7), declared by hand with their field numbers, and the
//! gRPC framing of one message. Only the fields the backend uses: protobuf skips the others when
//! it reads an answer, and leaves unset fields out when it writes a request. No `Debug` shows a
//! value (a record holds lease ids) or a password: each prints its type's name only.

use prost::Message;

/// `etcdserverpb.KV/Txn`.
pub(crate) const TXN: &str = "/etcdserverpb.KV/Txn";
/// `etcdserverpb.Lease/LeaseGrant`.
pub(crate) const LEASE_GRANT: &str = "/etcdserverpb.Lease/LeaseGrant";
/// `etcdserverpb.Auth/Authenticate`.
pub(crate) const AUTHENTICATE: &str = "/etcdserverpb.Auth/Authenticate";

/// `Compare.CompareTarget.CREATE`: the key's create revision (0 when it is absent).
pub(crate) const TARGET_CREATE: i32 = 1;
/// `Compare.CompareTarget.VALUE`: the key's value.
pub(crate) const TARGET_VALUE: i32 = 3;

/// Prints a message's type only.
macro_rules! opaque_debug {
    ($($name:ident),+) => {$(
        impl std::fmt::Debug for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(concat!(stringify!($name), " { .. }"))
            }
        }
    )+};
}

opaque_debug!(
    RangeRequest,
    PutRequest,
    Compare,
    RequestOp,
    TxnRequest,
    KeyValue,
    RangeResponse,
    PutResponse,
    ResponseOp,
    TxnResponse,
    LeaseGrantRequest,
    LeaseGrantResponse,
    AuthenticateRequest,
    AuthenticateResponse,
    CompareWith,
    Request,
    Response
);

#[derive(Clone, PartialEq, Message)]
#[prost(skip_debug)]
pub(crate) struct RangeRequest {
    #[prost(bytes = "vec", tag = "1")]
    pub key: Vec<u8>,
}

#[derive(Clone, PartialEq, Message)]
#[prost(skip_debug)]
pub(crate) struct PutRequest {
    #[prost(bytes = "vec", tag = "1")]
    pub key: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    pub value: Vec<u8>,
    /// The etcd lease the key is attached to (0: none).
    #[prost(int64, tag = "3")]
    pub lease: i64,
}

#[derive(Clone, PartialEq, Message)]
#[prost(skip_debug)]
pub(crate) struct Compare {
    /// `CompareResult`; 0 is `EQUAL`, the only one used.
    #[prost(int32, tag = "1")]
    pub result: i32,
    /// `CompareTarget`: [`TARGET_CREATE`] or [`TARGET_VALUE`].
    #[prost(int32, tag = "2")]
    pub target: i32,
    #[prost(bytes = "vec", tag = "3")]
    pub key: Vec<u8>,
    #[prost(oneof = "CompareWith", tags = "5, 7")]
    pub with: Option<CompareWith>,
}

/// What a [`Compare`] compares with (`target_union`).
#[derive(Clone, PartialEq, prost::Oneof)]
#[prost(skip_debug)]
pub(crate) enum CompareWith {
    #[prost(int64, tag = "5")]
    CreateRevision(i64),
    #[prost(bytes = "vec", tag = "7")]
    Value(Vec<u8>),
}

#[derive(Clone, PartialEq, Message)]
#[prost(skip_debug)]
pub(crate) struct RequestOp {
    #[prost(oneof = "Request", tags = "1, 2")]
    pub request: Option<Request>,
}

/// One operation of a transaction's branch.
#[derive(Clone, PartialEq, prost::Oneof)]
#[prost(skip_debug)]
pub(crate) enum Request {
    #[prost(message, tag = "1")]
    Range(RangeRequest),
    #[prost(message, tag = "2")]
    Put(PutRequest),
}

#[derive(Clone, PartialEq, Message)]
#[prost(skip_debug)]
pub(crate) struct TxnRequest {
    #[prost(message, repeated, tag = "1")]
    pub compare: Vec<Compare>,
    #[prost(message, repeated, tag = "2")]
    pub success: Vec<RequestOp>,
    #[prost(message, repeated, tag = "3")]
    pub failure: Vec<RequestOp>,
}

#[derive(Clone, PartialEq, Message)]
#[prost(skip_debug)]
pub(crate) struct KeyValue {
    #[prost(bytes = "vec", tag = "1")]
    pub key: Vec<u8>,
    #[prost(bytes = "vec", tag = "5")]
    pub value: Vec<u8>,
}

#[derive(Clone, PartialEq, Message)]
#[prost(skip_debug)]
pub(crate) struct RangeResponse {
    #[prost(message, repeated, tag = "2")]
    pub kvs: Vec<KeyValue>,
}

#[derive(Clone, PartialEq, Message)]
#[prost(skip_debug)]
pub(crate) struct PutResponse {}

#[derive(Clone, PartialEq, Message)]
#[prost(skip_debug)]
pub(crate) struct ResponseOp {
    #[prost(oneof = "Response", tags = "1, 2")]
    pub response: Option<Response>,
}

/// One result of the branch a transaction took.
#[derive(Clone, PartialEq, prost::Oneof)]
#[prost(skip_debug)]
pub(crate) enum Response {
    #[prost(message, tag = "1")]
    Range(RangeResponse),
    #[prost(message, tag = "2")]
    Put(PutResponse),
}

#[derive(Clone, PartialEq, Message)]
#[prost(skip_debug)]
pub(crate) struct TxnResponse {
    #[prost(bool, tag = "2")]
    pub succeeded: bool,
    #[prost(message, repeated, tag = "3")]
    pub responses: Vec<ResponseOp>,
}

#[derive(Clone, PartialEq, Message)]
#[prost(skip_debug)]
pub(crate) struct LeaseGrantRequest {
    /// `TTL`, in seconds.
    #[prost(int64, tag = "1")]
    pub ttl: i64,
}

#[derive(Clone, PartialEq, Message)]
#[prost(skip_debug)]
pub(crate) struct LeaseGrantResponse {
    /// `ID`.
    #[prost(int64, tag = "2")]
    pub id: i64,
    #[prost(string, tag = "4")]
    pub error: String,
}

#[derive(Clone, PartialEq, Message)]
#[prost(skip_debug)]
pub(crate) struct AuthenticateRequest {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub password: String,
}

#[derive(Clone, PartialEq, Message)]
#[prost(skip_debug)]
pub(crate) struct AuthenticateResponse {
    #[prost(string, tag = "2")]
    pub token: String,
}

/// One message as gRPC frames it: an uncompressed flag, its length (4 bytes, big-endian), the
/// message.
pub(crate) fn frame(message: &impl Message) -> Vec<u8> {
    let body = message.encode_to_vec();
    let mut framed = Vec::with_capacity(5 + body.len());
    framed.push(0);
    framed.extend_from_slice(&u32::try_from(body.len()).unwrap_or(u32::MAX).to_be_bytes());
    framed.extend_from_slice(&body);
    framed
}

/// The one message of a unary answer's body; `None` when the body is not one whole,
/// uncompressed message of type `M`.
pub(crate) fn unframe<M: Message + Default>(body: &[u8]) -> Option<M> {
    let (head, message) = body.split_at_checked(5)?;
    let (flag, length) = head.split_first()?;
    let length = u32::from_be_bytes(length.try_into().ok()?);
    if *flag != 0 || usize::try_from(length).ok()? != message.len() {
        return None;
    }
    M::decode(message).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A transaction that expects a key absent, puts it on a lease, and reads it on failure,
    /// byte by byte as protobuf writes the fields of etcd's rpc.proto (field numbers and wire
    /// types; the wire test against a real member is tests/store).
    #[test]
    fn a_transaction_encodes_as_etcd_reads_it() {
        let txn = TxnRequest {
            compare: vec![Compare {
                result: 0,
                target: TARGET_CREATE,
                key: b"k".to_vec(),
                with: Some(CompareWith::CreateRevision(0)),
            }],
            success: vec![RequestOp {
                request: Some(Request::Put(PutRequest {
                    key: b"k".to_vec(),
                    value: b"v".to_vec(),
                    lease: 5,
                })),
            }],
            failure: vec![RequestOp {
                request: Some(Request::Range(RangeRequest { key: b"k".to_vec() })),
            }],
        };
        let expected: Vec<u8> = vec![
            0x0a, 0x07, // compare, 7 bytes
            0x10, 0x01, // target CREATE
            0x1a, 0x01, b'k', // key
            0x28, 0x00, // create_revision 0 (a oneof member is written even when 0)
            0x12, 0x0a, // success, 10 bytes
            0x12, 0x08, // request_put, 8 bytes
            0x0a, 0x01, b'k', 0x12, 0x01, b'v', 0x18, 0x05, // key, value, lease 5
            0x1a, 0x05, // failure, 5 bytes
            0x0a, 0x03, 0x0a, 0x01, b'k', // request_range { key }
        ];
        assert_eq!(txn.encode_to_vec(), expected);
    }

    #[test]
    fn an_answer_decodes_and_a_bad_frame_is_refused() {
        // succeeded false, one range response with one key-value (key "k", value "v").
        let body: Vec<u8> = vec![
            0x1a, 0x0a, // responses, 10 bytes
            0x0a, 0x08, // response_range, 8 bytes
            0x12, 0x06, // kvs, 6 bytes
            0x0a, 0x01, b'k', 0x2a, 0x01, b'v', // key, value
        ];
        let mut framed = vec![0, 0, 0, 0, u8::try_from(body.len()).expect("short")];
        framed.extend_from_slice(&body);
        let txn: TxnResponse = unframe(&framed).expect("one message");
        assert!(!txn.succeeded);
        match &txn.responses[0].response {
            Some(Response::Range(range)) => assert_eq!(range.kvs[0].value, b"v"),
            other => panic!("not a range: {other:?}"),
        }
        assert!(unframe::<TxnResponse>(&framed[..framed.len() - 1]).is_none());
        let mut compressed = framed.clone();
        compressed[0] = 1;
        assert!(unframe::<TxnResponse>(&compressed).is_none());
        assert!(format!("{txn:?}").starts_with("TxnResponse"));
        let auth = AuthenticateRequest {
            name: "u".into(),
            password: "hunter2".into(),
        };
        assert!(!format!("{auth:?}").contains("hunter2"));
    }
}
