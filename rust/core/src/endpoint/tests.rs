//! The writer driven one command at a time, for orders of events that the endpoint's threads
//! cannot be made to produce on purpose.

use std::net::TcpListener;
use std::sync::mpsc::{self, Receiver};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::events::{Event, Outcome, Reason};
use super::writer::Writer;
use super::{EndpointConfig, Expectation, Shared};
use crate::layout::{KvLayout, Region, TokenOrder};
use crate::loopback::LoopbackTransport;
use crate::protocol::{BlockGroup, Hello, Message, PROTOCOL_VERSION};
use crate::side_channel::{
    ControlHandler, PeerId, PeerInfo, Refusal, SideChannel, SideChannelConfig,
};
use crate::transport::MemorySpace;

/// A handler for a side channel whose peers this test never hears from.
struct Deaf;

impl ControlHandler for Deaf {
    fn peer_joined(&self, _peer: &PeerInfo) -> Result<(), Refusal> {
        Ok(())
    }
    fn message(&self, _peer: PeerId, _message: Message) {}
    fn peer_lost(&self, _peer: PeerId, _reason: &str) {}
}

fn layout() -> KvLayout {
    KvLayout {
        regions: vec![Region { base: 0x10_000, block_stride: 256, num_blocks: 8, group: 0 }],
        block_tokens: 16,
        kernel_block_tokens: 16,
        heads: 2,
        head_bytes: 8,
        token_order: TokenOrder::Nhd,
        tp_rank: 0,
        tp_size: 1,
    }
}

fn hello(engine_id: &str) -> Hello {
    Hello {
        engine_id: engine_id.into(),
        tp_rank: 0,
        tp_size: 1,
        pp_rank: 0,
        pp_size: 1,
        agent_name: engine_id.into(),
        agent_metadata: Vec::new(),
        layout: layout(),
        compatibility: String::new(),
        versions: vec![PROTOCOL_VERSION],
        memory: MemorySpace::DRAM,
        nonce: 0,
        echo: 0,
        write_horizon_ms: 1_000,
        delivery_bound_ms: 0,
    }
}

/// A writer nobody runs: the test hands it each command itself, and reads its events. The
/// commands its own threads send (the connector's results) are never read.
fn writer(name: &str) -> (Writer<LoopbackTransport>, Receiver<Event>) {
    let config = EndpointConfig::new(name, layout());
    let (inbox, commands) = super::inbox::inbox(config.inbox_capacity);
    let (events, reports) = mpsc::channel();
    let shared = Arc::new(Shared::new(&config, inbox, Arc::new(crate::clock::SystemClock)));
    let side_channel =
        SideChannel::start(SideChannelConfig::new(config.bind, name), hello(name), Arc::new(Deaf))
            .expect("a side channel on loopback");
    let link =
        super::link::ChannelLink::new(Arc::new(side_channel), Arc::clone(&shared), name.to_owned());
    let transport = LoopbackTransport::new(name).expect("a fresh agent name");
    let writer = Writer::new(&config, transport, None, shared, Arc::new(link), commands, events);
    (writer, reports)
}

fn expectation(request_id: &str, source: &str) -> Expectation {
    Expectation {
        request_id: request_id.into(),
        transfer_id: None,
        sources: vec![source.to_owned()],
        groups: vec![BlockGroup { first_token: 0, block_ids: vec![1] }],
        num_tokens: 10,
        epoch: 1,
        ttl: Duration::from_secs(30),
        share: None,
    }
}

#[test]
fn a_connection_lost_before_its_result_came_is_not_kept_as_the_source() {
    let (mut writer, events) = writer("d-lost-on-connect");
    // Nobody listens there: the connector's own attempts fail, unread.
    let source = TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a port");
    let source = source.to_string();
    writer.receives.expect(&mut writer.cx, expectation("req-1", &source), Instant::now());
    // The connection to P joined and was lost before the connector's result reached the
    // writer: its `PeerLost` was handled first, so the writer no longer knows the peer.
    let info = PeerInfo {
        id: 99,
        addr: source.parse().expect("an address"),
        hello: hello("p"),
        inbound: false,
    };
    writer.receives.connected(&mut writer.cx, source.clone(), Ok(info));
    let failed = events.try_recv().expect("the waiting receive ends at once");
    assert!(
        matches!(&failed.outcome, Outcome::Failed(cause)
            if cause.reason == Reason::Unreachable && cause.contains("closed right after")),
        "{failed:?}"
    );
    // A later expectation connects again, instead of registering on the dead connection.
    writer.receives.expect(&mut writer.cx, expectation("req-2", &source), Instant::now());
    assert!(events.try_recv().is_err(), "req-2 was sent to the dead connection");
    writer.shut_down();
    let closed = events.try_recv().expect("closing ends req-2");
    assert_eq!(closed.request_id, "req-2");
    assert_eq!(closed.outcome.cause().map(|c| c.reason), Some(Reason::Closed));
}
