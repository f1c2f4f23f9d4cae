//! kvpush/1 control messages, their codec and authentication.
