//! The rendezvous table where D's registration meets P's finished KV.
