//! The transfer planner: from two layouts and two block lists to the (src, dst, len) runs to write.
