"""The containers: bounded ZIP and ``.npy`` readers and writers (byte-identical to ``np.savez`` and
``np.save``), and CRC-32."""
