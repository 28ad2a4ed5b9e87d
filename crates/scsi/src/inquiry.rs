//! INQUIRY: standard data and the vital product data pages (SPC-4 6.6, 7.8; SBC-3 6.5).

use crate::cdb::*;
use crate::lu::*;
use crate::sense::Sense;
use crate::{Command, Nexus};

pub const VPD_SUPPORTED_PAGES: u8 = 0x00;
pub const VPD_UNIT_SERIAL: u8 = 0x80;
pub const VPD_DEVICE_IDENTIFICATION: u8 = 0x83;
pub const VPD_BLOCK_LIMITS: u8 = 0xB0;
pub const VPD_BLOCK_DEVICE_CHARACTERISTICS: u8 = 0xB1;
pub const VPD_LOGICAL_BLOCK_PROVISIONING: u8 = 0xB2;

const VPD_PAGES: [u8; 6] = [
    VPD_SUPPORTED_PAGES,
    VPD_UNIT_SERIAL,
    VPD_DEVICE_IDENTIFICATION,
    VPD_BLOCK_LIMITS,
    VPD_BLOCK_DEVICE_CHARACTERISTICS,
    VPD_LOGICAL_BLOCK_PROVISIONING,
];

/// Version descriptors (SPC-4 table 29): SAM-5, SPC-4, SBC-3, iSCSI (no version claimed).
const VERSION_DESCRIPTORS: [u16; 4] = [0x00A0, 0x0460, 0x04C0, 0x0960];

/// Standard INQUIRY data length we build (the usual 96 bytes).
const STANDARD_BYTES: usize = 96;

/// Peripheral qualifier 011b, device type 1Fh: no logical unit at this LUN.
pub const NO_LU_PERIPHERAL: u8 = 0x7F;

/// Standard INQUIRY data for a LUN without a logical unit (SPC-4 6.6.2).
pub fn standard_inquiry_no_lu(out: &mut Vec<u8>) {
    out.extend_from_slice(&[NO_LU_PERIPHERAL, 0, 0x06, 0x12, 31, 0, 0, 0x02]);
    out.resize(36, b' ');
}

impl LogicalUnit {
    pub(crate) fn inquiry(
        &self,
        nexus: &Nexus,
        cmd: &Command<'_>,
        data_in: &mut Vec<u8>,
    ) -> Result<u32, Sense> {
        let cdb = Cdb(cmd.cdb);
        check_reserved(cdb, 1, 0x01)?; // CMDDT is obsolete
        let evpd = cdb.u8(1) & 0x01 != 0;
        let page = cdb.u8(2);
        let allocation = u32::from(cdb.be16(3));
        if !evpd {
            if page != 0 {
                return Err(Sense::invalid_field_in_cdb(2, None));
            }
            self.standard_inquiry(nexus, data_in);
        } else {
            self.vpd_page(nexus, page, data_in)?;
        }
        Ok(finish_data_in(data_in, allocation, cmd.data_in_limit))
    }

    fn standard_inquiry(&self, nexus: &Nexus, out: &mut Vec<u8>) {
        out.push(0x00); // connected direct-access block device
        out.push(0x00); // RMB=0: not removable
        out.push(0x06); // SPC-4
        out.push(0x12); // HISUP, response data format 2
        out.push((STANDARD_BYTES - 5) as u8);
        // TPGS = 01b (implicit ALUA) or 11b (and explicit, an LU whose owner lets initiators
        // move it); 3PC (EXTENDED COPY); no SCCS/ACC/PROTECT.
        let tpgs = if self.explicit_alua() { 0x30 } else { 0x10 };
        out.push(tpgs | 0x08);
        // MULTIP: the target has more than one port (a portal group each), as a multipath
        // initiator reaches it.
        let ports: usize = nexus.target_port.groups.iter().map(|g| g.ports.len()).sum();
        out.push(if ports > 1 { 0x10 } else { 0x00 });
        out.push(0x02); // CMDQUE
        let identity = self.identity();
        put_ascii(out, &identity.vendor, 8);
        put_ascii(out, &identity.product, 16);
        put_ascii(out, &identity.revision, 4);
        out.resize(58, 0);
        for d in VERSION_DESCRIPTORS {
            out.extend_from_slice(&d.to_be_bytes());
        }
        out.resize(STANDARD_BYTES, 0);
    }

    fn vpd_page(&self, nexus: &Nexus, page: u8, out: &mut Vec<u8>) -> Result<(), Sense> {
        out.extend_from_slice(&[0x00, page, 0, 0]);
        match page {
            VPD_SUPPORTED_PAGES => out.extend_from_slice(&VPD_PAGES),
            VPD_UNIT_SERIAL => out.extend_from_slice(self.identity().serial.as_bytes()),
            VPD_DEVICE_IDENTIFICATION => self.device_identification(nexus, out),
            VPD_BLOCK_LIMITS => self.block_limits(out),
            VPD_BLOCK_DEVICE_CHARACTERISTICS => {
                out.extend_from_slice(&[0x00, 0x01]); // medium rotation rate: non-rotating
                out.resize(4 + 0x3C, 0);
            }
            VPD_LOGICAL_BLOCK_PROVISIONING => {
                out.push(0); // threshold exponent
                if self.settings.thin {
                    // LBPU, LBPWS, LBPWS10, LBPRZ; no anchors, no descriptor present.
                    out.push(0x80 | 0x40 | 0x20 | 0x04);
                    out.push(0x02); // provisioning type: thin
                } else {
                    out.push(0);
                    out.push(0); // fully provisioned
                }
                out.push(0);
            }
            _ => return Err(Sense::invalid_field_in_cdb(2, None)),
        }
        let len = (out.len() - 4) as u16;
        out[2..4].copy_from_slice(&len.to_be_bytes());
        Ok(())
    }

    fn device_identification(&self, nexus: &Nexus, out: &mut Vec<u8>) {
        // NAA, logical unit association, binary.
        let identity = self.identity();
        let naa = &identity.naa[..identity.naa_len.min(16)];
        out.extend_from_slice(&[0x01, 0x03, 0, naa.len() as u8]);
        out.extend_from_slice(naa);
        // T10 vendor ID based, logical unit association, ASCII: vendor + serial.
        let mut t10 = Vec::with_capacity(8 + identity.serial.len());
        put_ascii(&mut t10, &identity.vendor, 8);
        t10.extend_from_slice(identity.serial.as_bytes());
        out.extend_from_slice(&[0x02, 0x01, 0, t10.len() as u8]);
        out.extend_from_slice(&t10);
        // Relative target port identifier, target port association.
        let port = &nexus.target_port;
        out.extend_from_slice(&[0x01, 0x14, 0, 4, 0, 0]);
        out.extend_from_slice(&port.relative_id.to_be_bytes());
        // Target port group (ALUA), target port association.
        out.extend_from_slice(&[0x01, 0x15, 0, 4, 0, 0]);
        out.extend_from_slice(&port.group.to_be_bytes());
        // SCSI name strings (UTF-8), target port and target device associations.
        put_name_designator(out, 0x18, &port.name);
        put_name_designator(out, 0x28, &port.target_name);
    }

    fn block_limits(&self, out: &mut Vec<u8>) {
        let shift = self.block_shift;
        out.push(0x01); // WSNZ: WRITE SAME with zero blocks is rejected
        out.push(COMPARE_AND_WRITE_BLOCKS_MAX);
        // Optimal transfer length granularity: one physical block.
        out.extend_from_slice(&((PHYSICAL_BLOCK_BYTES >> shift).max(1) as u16).to_be_bytes());
        out.extend_from_slice(&(TRANSFER_BYTES_MAX >> shift).to_be_bytes());
        out.extend_from_slice(&(TRANSFER_BYTES_OPTIMAL >> shift).to_be_bytes());
        out.extend_from_slice(&(TRANSFER_BYTES_MAX >> shift).to_be_bytes()); // max pre-fetch
        if self.settings.thin {
            out.extend_from_slice(&UNMAP_BLOCKS_MAX.to_be_bytes());
            out.extend_from_slice(&UNMAP_DESCRIPTORS_MAX.to_be_bytes());
            let granularity = (UNMAP_GRANULARITY_BYTES >> shift).max(1);
            out.extend_from_slice(&granularity.to_be_bytes());
        } else {
            out.extend_from_slice(&[0; 12]);
        }
        out.extend_from_slice(&[0; 4]); // unmap granularity alignment: not valid
        out.extend_from_slice(&u64::from(WRITE_SAME_BLOCKS_MAX).to_be_bytes());
        // Maximum atomic transfer length; atomic alignment and granularity 0 (no constraint);
        // atomic boundaries are not supported (both boundary fields 0).
        out.extend_from_slice(&(ATOMIC_BYTES_MAX >> shift).to_be_bytes());
        out.resize(4 + 0x3C, 0);
    }
}

/// SCSI name string designator: NUL-terminated, padded to a multiple of 4 (SPC-4 7.8.6.11).
fn put_name_designator(out: &mut Vec<u8>, association_and_type: u8, name: &str) {
    // The length field is one byte; names are bounded (iSCSI: 223 bytes) well below it.
    let bytes = &name.as_bytes()[..name.len().min(251)];
    let padded = (bytes.len() + 1).div_ceil(4) * 4;
    out.extend_from_slice(&[0x03, association_and_type, 0, padded as u8]);
    out.extend_from_slice(bytes);
    out.resize(out.len() + padded - bytes.len(), 0);
}
