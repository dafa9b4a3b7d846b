//! What a VM (so a session) may be at all, whatever the configuration:
//! the one set of shape ranges the config checks, the session layer
//! enforces and `docs/openapi.yaml` spells out.

use std::ops::RangeInclusive;

pub const VCPUS: RangeInclusive<u32> = 1..=64;
pub const MEM_MIB: RangeInclusive<u32> = 64..=65536;
pub const DISK_MIB: RangeInclusive<u32> = 16..=1_048_576;
