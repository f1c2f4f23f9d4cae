//! What the writer needs of the side channel, as a trait: the real [`SideChannel`] (through
//! [`ChannelLink`], which also owns the thread that makes D's connections), or a simulation's
//! network (`sim`).

use std::fmt;
use std::net::SocketAddr;
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use crate::protocol::Message;
use crate::side_channel::{PeerId, PeerInfo, SideChannel, SideChannelError};
use crate::sync::lock;

use super::writer::{Command, ConnectFailure};
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

    /// Stops connecting and closes every connection (see [`SideChannel::close`]).
    fn close(&self);
}

/// The real side channel, and the connector thread that makes D's connections: connecting
/// blocks (bounded by the connect timeout), so it runs there rather than on the writer, which
/// must keep polling.
pub(crate) struct ChannelLink {
    channel: Arc<SideChannel>,
    /// Where the connector thread reports (the writer's inbox).
    shared: Arc<Shared>,
    engine_id: String,
    /// The connector thread's queue and handle, started with the first connection asked for.
    connector: Mutex<Option<(Sender<String>, JoinHandle<()>)>>,
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
        let mut connector = lock(&self.connector);
        if connector.is_none() {
            let (requests, queue) = mpsc::channel::<String>();
            let side_channel = Arc::clone(&self.channel);
            let shared = Arc::clone(&self.shared);
            let spawned = thread::Builder::new()
                .name(format!("kvpush-connect-{}", self.engine_id))
                .spawn(move || {
                    for source in queue {
                        let result = side_channel
                            .connect(&source)
                            .map_err(|error| ConnectFailure::of(&error));
                        if !shared.send(Command::Connected { source, result }) {
                            break;
                        }
                    }
                });
            match spawned {
                Ok(handle) => *connector = Some((requests, handle)),
                Err(e) => {
                    return Err(ConnectFailure {
                        reason: format!("cannot start a connector thread: {e}"),
                        refused: false,
                    });
                }
            }
        }
        if let Some((requests, _)) = connector.as_ref() {
            let _ = requests.send(source.to_owned());
        }
        Ok(())
    }

    fn close(&self) {
        // Closing the request queue ends the connector thread after its current attempt.
        let connector = lock(&self.connector).take();
        if let Some((requests, handle)) = connector {
            drop(requests);
            let _ = handle.join();
        }
        self.channel.close();
    }
}
