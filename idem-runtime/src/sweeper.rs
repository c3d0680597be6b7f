//! The retention sweeper (to be written).
