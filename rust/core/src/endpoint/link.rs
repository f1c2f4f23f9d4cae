//! What the writer needs of the side channel, as a trait: the real [`SideChannel`] (through
//! [`ChannelLink`], which also owns the thread that makes D's connections), or a simulation's
//! network (`sim`).

use std::fmt;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::protocol::Message;
use crate::side_channel::{PeerId, PeerInfo, SideChannel, SideChannelError};
use crate::sync::lock;

use super::command::ConnectFailure;
use super::connector::Connector;
use super::Shared;

/// The writer's side of the side channel. The methods mean what [`SideChannel`]'s of the same
/// names do; see there.
pub(crate) trait Link: Send + Sync + fmt::Debug {
    /// Sends `message` to `peer` without waiting for it (see [`SideChannel::send`]).
    fn send(&self, peer: PeerId, message: &Message) -> Result<(), SideChannelError>;

    /// How long ago `peer` was last proven alive (see [`SideChannel::proof_age`]).
    fn proof_age(&self, peer: PeerId) -> Option<Duration>;

    /// Closes the connection to `peer`; its `peer_lost` follows.
    fn disconnect(&self, peer: PeerId);

    /// The address this side listens on.
    fn local_addr(&self) -> SocketAddr;

    /// The peers currently joined.
    fn peers(&self) -> Vec<PeerInfo>;

    /// D: starts connecting to P at `source` without waiting; the result comes to the writer
    /// as [`Command::Connected`]. `Err` when the attempt could not even start.
    fn request_connect(&self, source: &str) -> Result<(), ConnectFailure>;

    /// D: the writer took `source`'s connect result (a slot for the next connect is free).
    fn connect_finished(&self, _source: &str) {}

    /// Stops connecting and closes every connection (see [`SideChannel::close`]).
    fn close(&self);
}

/// The real side channel, and the connects D makes through it (`connector`: each on a thread
/// of its own, a few at a time, since connecting blocks for up to the connect timeout and the
/// writer must keep polling).
pub(crate) struct ChannelLink {
    channel: Arc<SideChannel>,
    /// Where connects report (the writer's inbox).
    shared: Arc<Shared>,
    engine_id: String,
    /// The connects being made, from the first one asked for.
    connector: Mutex<Option<Connector>>,
}

impl ChannelLink {
    pub(crate) fn new(channel: Arc<SideChannel>, shared: Arc<Shared>, engine_id: String) -> Self {
        Self { channel, shared, engine_id, connector: Mutex::new(None) }
    }
}

impl fmt::Debug for ChannelLink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChannelLink").field("channel", &self.channel).finish_non_exhaustive()
    }
}

impl Link for ChannelLink {
    fn send(&self, peer: PeerId, message: &Message) -> Result<(), SideChannelError> {
        self.channel.send(peer, message)
    }

    fn proof_age(&self, peer: PeerId) -> Option<Duration> {
        self.channel.proof_age(peer)
    }

    fn disconnect(&self, peer: PeerId) {
        self.channel.disconnect(peer);
    }

    fn local_addr(&self) -> SocketAddr {
        self.channel.local_addr()
    }

    fn peers(&self) -> Vec<PeerInfo> {
        self.channel.peers()
    }

    fn request_connect(&self, source: &str) -> Result<(), ConnectFailure> {
        lock(&self.connector)
            .get_or_insert_with(|| {
                Connector::new(&self.engine_id, Arc::clone(&self.channel), Arc::clone(&self.shared))
            })
            .request(source.to_owned());
        Ok(())
    }

    fn connect_finished(&self, source: &str) {
        if let Some(connector) = lock(&self.connector).as_mut() {
            connector.finished(source);
        }
    }

    fn close(&self) {
        // Waiting connects are dropped, running ones waited for briefly (each is bounded by the
        // connect timeout).
        if let Some(connector) = lock(&self.connector).take() {
            connector.close();
        }
        self.channel.close();
    }
}
