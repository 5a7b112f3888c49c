package shm

// FileID names a file by device and inode: what a path or a descriptor
// leads to. Two descriptors with one FileID map the same memory.
type FileID struct{ Dev, Ino uint64 }
