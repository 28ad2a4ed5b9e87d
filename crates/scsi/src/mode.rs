//! Mode parameters (SPC-4 7.5, SBC-3 6.4): caching (08h, WCE changeable), control (0Ah,
//! D_SENSE and SWP changeable) and informational exceptions (1Ch). Nothing is saveable.

use crate::cdb::*;
use crate::lu::LogicalUnit;
use crate::sense::Sense;
use crate::unit_attention::MODE_PARAMETERS_CHANGED;
use crate::{Command, Nexus};
use std::sync::atomic::{AtomicBool, Ordering};

pub const PAGE_CACHING: u8 = 0x08;
pub const PAGE_CONTROL: u8 = 0x0A;
pub const PAGE_INFORMATIONAL_EXCEPTIONS: u8 = 0x1C;
pub const PAGE_ALL: u8 = 0x3F;
const PAGES: [u8; 3] = [PAGE_CACHING, PAGE_CONTROL, PAGE_INFORMATIONAL_EXCEPTIONS];

const PC_CURRENT: u8 = 0;
const PC_CHANGEABLE: u8 = 1;
const PC_DEFAULT: u8 = 2;
const PC_SAVED: u8 = 3;

/// The changeable mode bits, read on the fast path without a lock.
pub struct ModeState {
    pub wce: AtomicBool,
    /// The WCE a reset returns to (the device's `write_cache`, changeable by the operator).
    pub default_wce: AtomicBool,
    pub d_sense: AtomicBool,
    /// Software write protect (control page SWP): medium writes get DATA PROTECT.
    pub swp: AtomicBool,
}

impl ModeState {
    pub fn new(wce: bool) -> Self {
        ModeState {
            wce: AtomicBool::new(wce),
            default_wce: AtomicBool::new(wce),
            d_sense: AtomicBool::new(false),
            swp: AtomicBool::new(false),
        }
    }
    pub fn reset(&self) {
        let wce = self.default_wce.load(Ordering::Relaxed);
        self.wce.store(wce, Ordering::Relaxed);
        self.d_sense.store(false, Ordering::Relaxed);
        self.swp.store(false, Ordering::Relaxed);
    }
}

/// Longest page we build (caching: 20 bytes).
const PAGE_BYTES_MAX: usize = 20;

impl LogicalUnit {
    /// One page for page control `pc`; `None` for an unknown page.
    fn mode_page(&self, code: u8, pc: u8) -> Option<([u8; PAGE_BYTES_MAX], usize)> {
        let mut p = [0u8; PAGE_BYTES_MAX];
        let (wce, d_sense, swp) = match pc {
            PC_CURRENT => (
                self.mode.wce.load(Ordering::Relaxed),
                self.mode.d_sense.load(Ordering::Relaxed),
                self.mode.swp.load(Ordering::Relaxed),
            ),
            PC_CHANGEABLE => (true, true, true), // the mask of changeable bits
            // PC_DEFAULT (saved values were refused earlier).
            _ => {
                debug_assert_eq!(pc, PC_DEFAULT);
                (self.mode.default_wce.load(Ordering::Relaxed), false, false)
            }
        };
        let len = match code {
            PAGE_CACHING => {
                p[0] = PAGE_CACHING;
                p[1] = 0x12;
                p[2] = if wce { 0x04 } else { 0 };
                20
            }
            PAGE_CONTROL => {
                p[0] = PAGE_CONTROL;
                p[1] = 0x0A;
                p[2] = if d_sense { 0x04 } else { 0 };
                p[4] = if swp { 0x08 } else { 0 };
                if pc != PC_CHANGEABLE {
                    p[3] = 0x10; // queue algorithm modifier 1: unrestricted reordering
                    p[8] = 0xFF; // busy timeout period: unlimited
                    p[9] = 0xFF;
                }
                12
            }
            PAGE_INFORMATIONAL_EXCEPTIONS => {
                p[0] = PAGE_INFORMATIONAL_EXCEPTIONS;
                p[1] = 0x0A;
                if pc != PC_CHANGEABLE {
                    p[2] = 0x08; // DEXCPT: no failure prediction to report
                }
                12
            }
            _ => return None,
        };
        Some((p, len))
    }

    pub(crate) fn mode_sense(
        &self,
        cmd: &Command<'_>,
        out: &mut Vec<u8>,
        write_protected: bool,
    ) -> Result<u32, Sense> {
        let cdb = Cdb(cmd.cdb);
        let six = cdb.u8(0) == MODE_SENSE_6;
        check_reserved(cdb, 1, if six { 0x08 } else { 0x18 })?;
        let dbd = cdb.u8(1) & 0x08 != 0;
        let llbaa = !six && cdb.u8(1) & 0x10 != 0;
        let pc = cdb.u8(2) >> 6;
        let page = cdb.u8(2) & 0x3F;
        let subpage = cdb.u8(3);
        let allocation = if six {
            u32::from(cdb.u8(4))
        } else {
            u32::from(cdb.be16(7))
        };
        if pc == PC_SAVED {
            return Err(Sense::saving_parameters_not_supported());
        }
        // Validate the page before building anything.
        let known = page == PAGE_ALL || PAGES.contains(&page);
        if !known {
            return Err(Sense::invalid_field_in_cdb(2, Some(5)));
        }
        if subpage != 0 && subpage != 0xFF {
            return Err(Sense::invalid_field_in_cdb(3, None));
        }
        let device_specific = if write_protected { 0x80 } else { 0 } | 0x10; // WP, DPOFUA
        let header = if six { 4 } else { 8 };
        out.resize(header, 0);
        if six {
            out[2] = device_specific;
        } else {
            out[3] = device_specific;
        }
        if !dbd {
            let blocks = if pc == PC_CHANGEABLE {
                0
            } else {
                self.block_count()
            };
            let block_len = if pc == PC_CHANGEABLE {
                0
            } else {
                self.settings.block_size
            };
            if llbaa {
                out[4] = 0x01; // LONGLBA
                out[7] = 16;
                out.extend_from_slice(&blocks.to_be_bytes());
                out.extend_from_slice(&[0; 4]);
                out.extend_from_slice(&block_len.to_be_bytes());
            } else {
                if six {
                    out[3] = 8;
                } else {
                    out[7] = 8;
                }
                let short = u32::try_from(blocks).unwrap_or(u32::MAX);
                out.extend_from_slice(&short.to_be_bytes());
                out.extend_from_slice(&block_len.to_be_bytes()); // byte 4 is reserved (0)
            }
        }
        for code in PAGES {
            if page == PAGE_ALL || page == code {
                if let Some((p, len)) = self.mode_page(code, pc) {
                    out.extend_from_slice(&p[..len]);
                }
            }
        }
        if six {
            out[0] = (out.len() - 1).min(255) as u8;
        } else {
            let len = (out.len() - 2) as u16;
            out[..2].copy_from_slice(&len.to_be_bytes());
        }
        Ok(finish_data_in(out, allocation, cmd.data_in_limit))
    }

    pub(crate) fn mode_select(&self, nexus: &Nexus, cmd: &Command<'_>) -> Result<u32, Sense> {
        let cdb = Cdb(cmd.cdb);
        let six = cdb.u8(0) == MODE_SELECT_6;
        check_reserved(cdb, 1, 0x11)?;
        if cdb.u8(1) & 0x01 != 0 {
            return Err(Sense::invalid_field_in_cdb(1, Some(0))); // SP: nothing is saveable
        }
        let param_len = if six {
            usize::from(cdb.u8(4))
        } else {
            usize::from(cdb.be16(7))
        };
        if param_len == 0 {
            return Ok(0);
        }
        if cdb.u8(1) & 0x10 == 0 {
            // PF=0 would mean vendor-specific page formats.
            return Err(Sense::invalid_field_in_cdb(1, Some(4)));
        }
        let p = &cmd.data_out[..param_len.min(cmd.data_out.len())];
        let header = if six { 4 } else { 8 };
        if p.len() < header {
            return Err(Sense::parameter_list_length_error());
        }
        let (bd_len, bd_len_at) = if six {
            (usize::from(p[3]), 3u16)
        } else {
            (usize::from(param_be16(p, 6).unwrap_or(0)), 6u16)
        };
        let long = !six && p[4] & 0x01 != 0;
        if bd_len != 0 {
            self.check_block_descriptor(p, header, bd_len, bd_len_at, long)?;
        }
        let mut wce = self.mode.wce.load(Ordering::Relaxed);
        let mut d_sense = self.mode.d_sense.load(Ordering::Relaxed);
        let mut swp = self.mode.swp.load(Ordering::Relaxed);
        let mut at = header + bd_len;
        if at > p.len() {
            return Err(Sense::parameter_list_length_error());
        }
        while at < p.len() {
            let (code, given, end) = self.changed_page(p, at)?;
            match code {
                PAGE_CACHING => wce = given[2] & 0x04 != 0,
                PAGE_CONTROL => {
                    d_sense = given[2] & 0x04 != 0;
                    swp = given[4] & 0x08 != 0;
                }
                _ => {}
            }
            at = end;
        }
        let old_wce = self.mode.wce.swap(wce, Ordering::Relaxed);
        let old_d_sense = self.mode.d_sense.swap(d_sense, Ordering::Relaxed);
        let old_swp = self.mode.swp.swap(swp, Ordering::Relaxed);
        if old_wce && !wce {
            // Write-through from now on: what the cache held must be durable too.
            self.store
                .flush()
                .map_err(|_| Sense::medium_error_write())?;
        }
        if old_wce != wce || old_d_sense != d_sense || old_swp != swp {
            self.ua.raise_all(MODE_PARAMETERS_CHANGED, Some(nexus.id));
        }
        Ok(param_len as u32)
    }

    /// A MODE SELECT block descriptor may only restate the LU: its block length, and its
    /// block count or 0.
    fn check_block_descriptor(
        &self,
        p: &[u8],
        header: usize,
        bd_len: usize,
        bd_len_at: u16,
        long: bool,
    ) -> Result<(), Sense> {
        let want = if long { 16 } else { 8 };
        if bd_len != want {
            return Err(Sense::invalid_field_in_parameter_list(bd_len_at, None));
        }
        let d = p
            .get(header..header + bd_len)
            .ok_or(Sense::parameter_list_length_error())?;
        let (blocks, block_len, len_at) = if long {
            (
                param_be64(d, 0).unwrap_or(0),
                param_be32(d, 12).unwrap_or(0),
                12,
            )
        } else {
            let blocks = u64::from(param_be32(d, 0).unwrap_or(0));
            (blocks, param_be32(d, 4).unwrap_or(0) & 0x00FF_FFFF, 5)
        };
        if block_len != self.settings.block_size {
            return Err(Sense::invalid_field_in_parameter_list(
                (header + len_at) as u16,
                None,
            ));
        }
        let count = self.block_count();
        let short_count = count.min(u64::from(u32::MAX));
        let matches = blocks == 0 || blocks == count || (!long && blocks == short_count);
        if !matches {
            return Err(Sense::invalid_field_in_parameter_list(header as u16, None));
        }
        Ok(())
    }

    /// The mode page at `at` of a MODE SELECT parameter list: its code, its bytes and where
    /// the next begins. A page changes only what its changeable mask allows (PS is ignored;
    /// bytes 0 and 1, the code and the length, are checked against the current page).
    fn changed_page<'p>(&self, p: &'p [u8], at: usize) -> Result<(u8, &'p [u8], usize), Sense> {
        let code = p[at] & 0x3F;
        if p[at] & 0x40 != 0 {
            return Err(Sense::invalid_field_in_parameter_list(at as u16, Some(6)));
        }
        let page_len = usize::from(*p.get(at + 1).ok_or(Sense::parameter_list_length_error())?);
        let end = at + 2 + page_len;
        let given = p.get(at..end).ok_or(Sense::parameter_list_length_error())?;
        let Some((current, len)) = self.mode_page(code, PC_CURRENT) else {
            return Err(Sense::invalid_field_in_parameter_list(at as u16, Some(5)));
        };
        if len != given.len() {
            return Err(Sense::invalid_field_in_parameter_list(at as u16 + 1, None));
        }
        let (mask, _) = self
            .mode_page(code, PC_CHANGEABLE)
            .unwrap_or(([0; PAGE_BYTES_MAX], 0));
        for i in 2..len {
            let bad = (given[i] ^ current[i]) & !mask[i];
            if bad != 0 {
                let bit = 7 - bad.leading_zeros() as u8;
                return Err(Sense::invalid_field_in_parameter_list(
                    (at + i) as u16,
                    Some(bit),
                ));
            }
        }
        Ok((code, given, end))
    }
}
